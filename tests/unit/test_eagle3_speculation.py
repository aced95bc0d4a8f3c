"""Speculative decoding with an EAGLE-3 head (`{"method": "eagle3"}`) on the mock: a tiny random
Llama target reading out the inputs of its layers 1, 2 and 3, and a head in the common format.

The head's forward matches a numpy transcription of vLLM's (every token's output hidden state
and the last one's draft); in the engine, tokens and logprobs equal plain decoding's with a
random head and with one made to predict the target's next token from its hidden states
(`predicting_eagle3`), whose first drafts are accepted; every block comes back.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from fakes import DictWeights, random_llama_weights
from helpers.draft_heads import (
    MAX_LEN,
    TARGET_LLAMA,
    TINY_EAGLE3,
    bigram_target,
    build_eagle3_core,
    predicting_eagle3,
    random_eagle3_weights,
)
from helpers.engines import make_worker
from helpers.tiny_engine import prompts, run
from test_engine_speculation import assert_same_outputs, outputs, requests_for

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.adapters.mock.dense import rmsnorm
from atlas.domain.batch import SamplingRow, ScheduledBatch, ScheduledSequence
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.draft_heads import HeadWorker
from atlas.domain.models.eagle3 import TargetFacts, load_eagle3
from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.config import SpeculativeConfig
from atlas.domain.worker import WorkerConfig
from atlas.ports.weights import WeightError

TARGET = random_llama_weights(TARGET_LLAMA, seed=4)
HEAD = random_eagle3_weights()
BIGRAM, FOLLOWS = bigram_target(TARGET)
PREDICTING = predicting_eagle3(BIGRAM, FOLLOWS)
GREEDY = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)


def eagle3(k):
    return SpeculativeConfig.from_mapping({"method": "eagle3", "num_speculative_tokens": k, "model": "head"})


def facts(target=TARGET):
    return TargetFacts(64, 97, 4, lambda: target["model.embed_tokens.weight"])


def f32(array):
    return np.asarray(array).astype(np.float32)


def reference(head, target, tokens, aux):
    """vLLM's EAGLE-3 step in numpy over one sequence: every token's output hidden state, and
    the draft vocabulary's logits of each."""
    eps, hidden, num_heads, kv_heads, dim = 1e-5, 64, 4, 2, 16
    layer = {name.removeprefix("midlayer."): f32(value) for name, value in head.items()}
    g = aux @ f32(head["fc.weight"]).T
    embedded = f32(target["model.embed_tokens.weight"])[tokens]
    joined = np.concatenate([rmsnorm(embedded, layer["input_layernorm.weight"], eps),
                             rmsnorm(g, layer["hidden_norm.weight"], eps)], axis=1)
    q = (joined @ layer["self_attn.q_proj.weight"].T).reshape(len(tokens), num_heads, dim)
    k = (joined @ layer["self_attn.k_proj.weight"].T).reshape(len(tokens), kv_heads, dim)
    v = (joined @ layer["self_attn.v_proj.weight"].T).reshape(len(tokens), kv_heads, dim)
    angles = np.arange(len(tokens))[:, None] * 10000.0 ** (-np.arange(0, dim, 2) / dim)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    def rotate(x):
        first, second = x[..., : dim // 2], x[..., dim // 2 :]
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)

    q, k = rotate(q), rotate(k)
    k, v = np.repeat(k, num_heads // kv_heads, axis=1), np.repeat(v, num_heads // kv_heads, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    scores = np.where(np.tril(np.ones((len(tokens),) * 2, bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("hqk,khd->qhd", weights, v).reshape(len(tokens), hidden)
    residual = g + attended @ layer["self_attn.o_proj.weight"].T
    normed = rmsnorm(residual, layer["post_attention_layernorm.weight"], eps)
    gate, up = normed @ layer["mlp.gate_proj.weight"].T, normed @ layer["mlp.up_proj.weight"].T
    residual = residual + (gate / (1 + np.exp(-gate)) * up) @ layer["mlp.down_proj.weight"].T
    return residual, rmsnorm(residual, f32(head["norm.weight"]), eps) @ f32(head["lm_head.weight"]).T


@pytest.mark.parametrize("spelling", ["midlayer.", "layers.0.", "model.layers.0."])
def test_the_heads_step_is_vllms_on_every_token(rng, spelling):
    head = random_eagle3_weights(spelling=spelling)
    backend = MockGpuBackend()
    loaded = load_eagle3(ModelConfig.from_dict(TINY_EAGLE3), DictWeights(head), backend, MAX_LEN, 32, facts())
    assert loaded.target_layers == (0, 1, 2)
    worker = make_worker(loaded.model, 8, 4, WorkerConfig(32, 4, MAX_LEN, keep_hidden_layers=(0,)))
    runner = HeadWorker(worker, loaded.buffers.hidden, 3 * 64, loaded.fuse, loaded.target_ids)
    tokens = [int(t) for t in rng.integers(0, 97, size=9)]
    aux = rng.standard_normal((9, 3 * 64)).astype(np.float32)
    batch = ScheduledBatch(0, (ScheduledSequence("a", tuple(tokens), 0, (0, 1, 2), GREEDY),), 4)
    result = runner.execute(batch, aux, from_target=True)
    canonical = {name.replace(spelling, "midlayer."): value for name, value in head.items()}
    hidden, logits = reference(canonical, TARGET, tokens, aux.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_allclose(result.hidden_states, hidden, rtol=3e-2, atol=0.01 * np.abs(hidden).max())
    draft_id = int(np.argmax(logits[-1]))
    assert result.token_ids == (draft_id + int(head["d2t"][draft_id]),)


def test_a_later_draft_step_reads_the_heads_own_hidden_state_unfused(rng):
    backend = MockGpuBackend()
    loaded = load_eagle3(ModelConfig.from_dict(TINY_EAGLE3), DictWeights(HEAD), backend, MAX_LEN, 32, facts())
    worker = make_worker(loaded.model, 8, 4, WorkerConfig(32, 4, MAX_LEN, keep_hidden_layers=(0,)))
    runner = HeadWorker(worker, loaded.buffers.hidden, 3 * 64, loaded.fuse, loaded.target_ids)
    own = rng.standard_normal((1, 64)).astype(np.float32)
    batch = ScheduledBatch(0, (ScheduledSequence("a", (7,), 0, (0,), GREEDY),), 4)
    result = runner.execute(batch, own, from_target=False)
    identity_fc = {**HEAD, "fc.weight": np.zeros((64, 3 * 64), np.float32)}  # g = own, through no fc
    expected, _ = reference(identity_fc, TARGET, [7], np.zeros((1, 3 * 64), np.float32))
    expected_from_own, _ = reference({**HEAD, "fc.weight": np.eye(64, 3 * 64, dtype=np.float32)}, TARGET, [7],
                                     np.pad(own, ((0, 0), (0, 128))))
    np.testing.assert_allclose(result.hidden_states, expected_from_own, rtol=3e-2, atol=3e-2)
    assert not np.allclose(expected, expected_from_own, atol=1e-2)


@pytest.mark.parametrize("head", ["random", "predicting"])
@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}, {"num_blocks": 40}, {"graph_sizes": (1, 2, 4, 8, 16, 32)}],
                         ids=["plain", "chunked-prefill", "preemption", "graphs"])
def test_eagle3_gives_the_tokens_and_logprobs_of_plain_decoding(rng, head, kwargs):
    target, weights = (TARGET, HEAD) if head == "random" else (BIGRAM, PREDICTING)
    requests = requests_for(rng)
    expected = outputs(build_eagle3_core(target, **kwargs), requests)
    core = build_eagle3_core(target, weights, eagle3(2), **kwargs)
    assert_same_outputs(outputs(core, requests), expected)
    stats = core.stats()
    assert stats.num_spec_verify_steps > 10 and stats.num_spec_draft_tokens > 0
    if head == "predicting":  # the sampled rows of the mix mostly reject: not every greedy draft is their token
        assert stats.spec_accepted_by_position[0] > 0.5 * stats.num_spec_verify_steps
    assert stats.num_blocks_free == stats.num_blocks_total
    proposer = core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks and proposer.num_sequences == 0
    if "num_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_a_head_predicting_from_the_targets_hidden_states_has_its_drafts_accepted(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True), seed=i)
                for i, p in enumerate(prompts(5, rng))]
    core = build_eagle3_core(BIGRAM, PREDICTING, eagle3(1))
    assert run(core, requests) == run(build_eagle3_core(BIGRAM), requests)
    stats = core.stats()
    assert stats.num_spec_accepted_tokens > 0.8 * stats.num_spec_draft_tokens
    # the random head of the same target is not: the hidden states carry the prediction
    core = build_eagle3_core(BIGRAM, HEAD, eagle3(1))
    assert run(core, requests) == run(build_eagle3_core(BIGRAM), requests)
    assert core.stats().num_spec_accepted_tokens < 0.5 * core.stats().num_spec_draft_tokens


def load(head=HEAD, **config):
    return load_eagle3(ModelConfig.from_dict({**TINY_EAGLE3, **config}), DictWeights(head), MockGpuBackend(), MAX_LEN,
                       32, facts())


def test_a_head_without_embeddings_reads_the_targets_and_aux_ids_default_to_vllms():
    loaded = load(eagle_config={})
    assert loaded.target_layers == (1, 1, 0)  # ids (2, 4 // 2, 4 - 3): the inputs of layers 2, 2 and 1


@pytest.mark.parametrize("change, error, message", [
    ({"architectures": ["LlamaForCausalLM"]}, ModelConfigError, "not an EAGLE-3 head"),
    ({"num_hidden_layers": 2}, ModelConfigError, "heads of one layer"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}, ModelConfigError, "take ids 1 .. 3"),
    ({"norm_before_residual": True}, ModelConfigError, "norm_before_residual"),
    ({"target_hidden_size": 32}, ModelConfigError, "target_hidden_size"),
    ({"vocab_size": 100}, ModelConfigError, "vocab_size: 100"),
])
def test_a_config_atlas_cannot_run_is_refused_naming_the_field(change, error, message):
    with pytest.raises(error, match=message):
        load(**change)


@pytest.mark.parametrize("missing, message", [
    ("fc.weight", "'fc.weight'"),
    ("midlayer.hidden_norm.weight", "'midlayer.hidden_norm.weight'"),
    ("d2t", "no d2t tensor"),
])
def test_a_missing_tensor_is_refused_naming_it(missing, message):
    with pytest.raises(WeightError, match=message):
        load({name: value for name, value in HEAD.items() if name != missing})


def test_a_d2t_outside_the_targets_vocabulary_is_refused():
    with pytest.raises(WeightError, match="outside the target's vocabulary"):
        load({**HEAD, "d2t": np.full(64, 90, np.int64)})
