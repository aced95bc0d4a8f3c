"""Qwen3-Next end to end on the mock: a tiny random checkpoint written by transformers, served by
`atlas.LLM`, matches transformers' float32 logprobs under teacher forcing through chunked
prefill, batched decode, preemption, state-slot reuse and graph replay; its MTP head loads."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fakes import DictWeights  # noqa: E402
from helpers.engines import make_cache, make_worker  # noqa: E402
from tiny_models import teacher_forced_gap, tiny_config, write_model_folder  # noqa: E402

import atlas  # noqa: E402
from atlas.adapters.mock.backend import MockGpuBackend  # noqa: E402
from atlas.adapters.mock.dense import rmsnorm  # noqa: E402
from atlas.adapters.weights.safetensors import SafetensorsWeights  # noqa: E402
from atlas.domain.engine import EngineCore  # noqa: E402
from atlas.domain.models import qwen3_next  # noqa: E402
from atlas.domain.models.cache_groups import CacheGroupKind  # noqa: E402
from atlas.domain.models.config import ModelConfig, ModelConfigError  # noqa: E402
from atlas.domain.models.families import load_model  # noqa: E402
from atlas.domain.requests import Request, SamplingParams  # noqa: E402
from atlas.domain.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from atlas.domain.worker import WorkerConfig  # noqa: E402
from atlas.ports.gpu import DType, Kind, MissingKindError  # noqa: E402
from atlas.ports.weights import WeightError  # noqa: E402

pytestmark = pytest.mark.oracle

BLOCK_SIZE = 8
MAX_NUM_SEQS = 3
NUM_KV_BLOCKS = 24  # three sequences of up to 104 tokens need 39: some are preempted
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-next")
    reference = write_model_folder(folder, "qwen3_next")
    return folder, reference


def _config(folder) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((folder / "config.json").read_text()))


def _prompts(vocab_size: int, lengths=(40, 25, 33, 12), seed=0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, vocab_size, size=n)] for n in lengths]


@pytest.fixture(scope="module")
def llm(checkpoint):
    """Three state slots and 24 KV blocks of 8 tokens, a 16-token step budget: a 40-token
    prompt runs in three chunks, decodes batch, and sequences are preempted to fit."""
    folder, _ = checkpoint
    config = _config(folder)
    groups = qwen3_next.cache_groups(config, qwen3_next.Qwen3NextShape.from_config(config))
    pages = [NUM_KV_BLOCKS if group.kind.is_kv else MAX_NUM_SEQS for group in groups]
    budget = sum((n + 1) * group.bytes_per_page(BLOCK_SIZE, DType.F32) for group, n in zip(groups, pages))
    return atlas.LLM(
        str(folder), device="mock", show_progress=False, max_seq_len=128, max_prefill_tokens=16,
        max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE, kv_cache_gb=budget / 2**30,
    )


def test_the_cache_groups_are_the_deltanet_state_slots_and_the_attention_pages(llm):
    model = llm.engine.model
    assert model.kinds == {Kind.DENSE, Kind.ATTENTION, Kind.RECURRENT, Kind.MOE}
    assert [(group.kind, group.layers) for group in model.cache_groups] == [
        (CacheGroupKind.RECURRENT_STATE, (0, 2)), (CacheGroupKind.FULL_ATTENTION, (1, 3))
    ]
    pools = [group.pool for group in llm.engine.core.scheduler.cache.groups]
    assert [(pool.num_blocks, pool.block_size) for pool in pools] == [(MAX_NUM_SEQS, 1), (NUM_KV_BLOCKS, BLOCK_SIZE)]


def test_logprobs_match_transformers_under_teacher_forcing_through_chunks_batches_and_preemption(llm, checkpoint):
    """Four prompts for three slots (one reuses a finished sequence's slot, which must start
    from zero state), 64 greedy tokens each; Atlas's logprob of every token it chose is within
    1e-3 of transformers' float32 on the same tokens."""
    _, reference = checkpoint
    prompts = _prompts(reference.config.vocab_size)
    outputs = llm.generate(prompts, GREEDY)
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0
    assert stats.num_blocks_free == stats.num_blocks_total
    for prompt, output in zip(prompts, outputs):
        choice = output.outputs[0]
        assert len(choice.token_ids) == 64 and len(choice.logprobs) == 64
        assert teacher_forced_gap(reference, prompt, choice.token_ids, choice.logprobs) < 1e-3


def test_a_repeated_prompt_is_computed_again_not_served_from_the_prefix_cache(llm, checkpoint):
    """No state is snapshotted at block boundaries, so a recurrent model takes no prefix hit:
    the repeat computes its prompt in full and gives the same tokens."""
    _, reference = checkpoint
    prompt = _prompts(reference.config.vocab_size, lengths=(37,), seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, again = (llm.generate([prompt], params)[0] for _ in range(2))
    assert again.num_cached_tokens == 0 and llm.engine.core.stats().num_prefix_cache_hits == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def _core(folder, graph_sizes: tuple[int, ...]) -> EngineCore:
    config = _config(folder)
    backend = MockGpuBackend(emulate_graphs=bool(graph_sizes))
    model = load_model(config, SafetensorsWeights(folder), backend, max_positions=128)
    worker = make_worker(model, 64, BLOCK_SIZE, WorkerConfig(64, 4, 128, graph_sizes))
    scheduler = Scheduler(SchedulerConfig(128, 4, 64, BLOCK_SIZE), make_cache(model, 64, BLOCK_SIZE, 4))
    return EngineCore(scheduler, worker, 128, config.vocab_size, frozenset())


def _run(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        core.add_request(Request(f"r{index}", tuple(prompt), params, seed=index))
    while core.has_unfinished:
        for output in core.step():
            tokens.setdefault(output.seq_id, []).extend(output.new_token_ids)
        core.scheduler.check_invariants()
    return tokens


def test_decode_graphs_pad_into_the_scratch_slot_and_give_the_eager_tokens(checkpoint):
    """Three sequences decode through a graph of four rows: the padding row runs the recurrent
    layers into the scratch slot, so no real sequence's state changes."""
    folder, reference = checkpoint
    prompts = _prompts(reference.config.vocab_size, lengths=(9, 20, 5), seed=2)
    graphed, eager = _core(folder, (4,)), _core(folder, ())
    assert _run(graphed, prompts) == _run(eager, prompts)
    assert graphed.executor.cache_layout.state_scratch_slots == (4,)


def test_atlas_doctor_finds_every_layer_within_the_noise_in_float32_and_bf16(checkpoint):
    """Float32 on the mock: summation-order error only. bf16 activations: within three times
    transformers' own bf16 error, layer by layer."""
    from atlas.app.doctor import run_doctor

    folder, _ = checkpoint
    prompt = "The capital of France is Paris. The capital of Italy is"
    exact = run_doctor(str(folder), device="mock", prompt=prompt, write=lambda line: None)
    assert exact.passed and [check.kind for check in exact.layers] == [
        "gated deltanet + moe", "gated attention + moe", "gated deltanet + dense", "gated attention + moe"
    ]
    assert max(check.error for check in exact.layers) < 1e-5
    rounded = run_doctor(str(folder), device="mock", dtype="bf16", prompt=prompt, write=lambda line: None)
    assert rounded.passed and all(check.error > 1e-4 for check in rounded.layers)  # it did round


def test_a_reused_state_slot_starts_from_zero_whatever_it_held(checkpoint, rng):
    """Sequence a fills slot 0 (a prompt and a decode), then b starts in slot 0 over a's pages:
    b's logits are those b gets on a fresh worker, so nothing of a's state leaks."""
    from atlas.domain.batch import BlockTable, SamplingRow, ScheduledBatch, ScheduledSequence

    folder, reference = checkpoint
    greedy = SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, counter=0)
    a, b = _prompts(reference.config.vocab_size, lengths=(21, 13), seed=7)

    def step(seq_id, tokens, start):
        blocks = tuple(range(-(-(start + len(tokens)) // BLOCK_SIZE)))
        return ScheduledSequence(seq_id, tuple(tokens), start, blocks, greedy, kv_block_tables=(BlockTable(blocks),),
                                 state_slots=(0,))

    def worker():
        model = load_model(_config(folder), SafetensorsWeights(folder), MockGpuBackend(), max_positions=128)
        return make_worker(model, 8, BLOCK_SIZE, WorkerConfig(64, 2, 128))

    used = worker()
    used.compute_logits(ScheduledBatch(0, (step("a", a, 0),), BLOCK_SIZE))
    used.compute_logits(ScheduledBatch(1, (step("a", [5], len(a)),), BLOCK_SIZE))
    reused = used.compute_logits(ScheduledBatch(2, (step("b", b, 0),), BLOCK_SIZE))
    fresh = worker().compute_logits(ScheduledBatch(0, (step("b", b, 0),), BLOCK_SIZE))
    np.testing.assert_array_equal(reused, fresh)


def test_ngram_speculation_through_the_builder_gives_plain_decodings_tokens_with_snapshot_slots_planned(checkpoint):
    """The memory plan gives the state group a slot per sequence and one per draft of each
    (2 + 2 x 3); the tokens are plain decoding's; drafts are verified."""
    folder, reference = checkpoint
    settings = dict(device="mock", show_progress=False, max_seq_len=128, max_num_seqs=2, kv_cache_gb=0.01)
    plain = atlas.LLM(str(folder), **settings)
    speculating = atlas.LLM(str(folder), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1}, **settings)
    assert plain.engine.num_pages[0] == 2 and speculating.engine.num_pages[0] == 2 + 2 * 3
    # its verify steps run eagerly (the recurrent groups see each chunk whole): no verify-sized graphs
    graph_sizes = [llm.engine.core.executor.config.graph_batch_sizes for llm in (plain, speculating)]
    assert graph_sizes[1] == graph_sizes[0] == (1, 2)
    prompts = [[5, 6, 7, 8] * 6, _prompts(reference.config.vocab_size, lengths=(19,), seed=2)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [output.outputs[0].token_ids for output in plain.generate(prompts, params)]
    assert [output.outputs[0].token_ids for output in speculating.generate(prompts, params)] == expected
    stats = speculating.engine.core.stats()
    assert stats.num_spec_verify_steps > 0 and stats.num_blocks_free == stats.num_blocks_total


def test_a_backend_without_the_recurrent_and_moe_kinds_is_refused_naming_them(checkpoint):
    folder, _ = checkpoint

    class AttentionOnly(MockGpuBackend):
        @property
        def capabilities(self):
            caps = super().capabilities
            return type(caps)(caps.activation_dtype, caps.kv_dtypes, frozenset({Kind.DENSE, Kind.ATTENTION, Kind.SAMPLING}),
                              caps.supports_graphs, caps.device_name)

    with pytest.raises(MissingKindError, match="Qwen3NextForCausalLM needs the moe, recurrent kernels"):
        load_model(_config(folder), DictWeights({}), AttentionOnly(), 128)


def test_layer_types_follow_the_interval_and_bad_fields_are_named():
    config = ModelConfig.from_dict(tiny_config("qwen3_next", layer_types=None, full_attention_interval=2))
    shape = qwen3_next.Qwen3NextShape.from_config(config)
    assert shape.layer_types == ("linear_attention", "full_attention") * 2
    assert [shape.is_moe(layer) for layer in range(4)] == [True, True, False, True]
    with pytest.raises(ModelConfigError, match="layer_types must list"):
        qwen3_next.Qwen3NextShape.from_config(ModelConfig.from_dict(tiny_config("qwen3_next", layer_types=["x"] * 4)))
    with pytest.raises(ModelConfigError, match="linear_num_key_heads"):
        raw = tiny_config("qwen3_next")
        del raw["linear_num_key_heads"]
        qwen3_next.Qwen3NextShape.from_config(ModelConfig.from_dict(raw))


def _mtp_tensors(reference, rng) -> dict[str, np.ndarray]:
    """An MTP head as the published checkpoints hold it: fc, its two norms, one full-attention
    MoE layer (here layer 1's weights), the final norm."""
    weights = {name: value.detach().float().numpy() for name, value in reference.state_dict().items()}
    hidden = reference.config.hidden_size
    mtp = {name.replace("model.layers.1.", "mtp.layers.0."): value
           for name, value in weights.items() if name.startswith("model.layers.1.")}
    mtp["mtp.fc.weight"] = rng.standard_normal((hidden, 2 * hidden)).astype(np.float32) * 0.1
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = rng.standard_normal(hidden).astype(np.float32) * 0.1
    return {**weights, **mtp}


def test_the_mtp_head_loads_as_a_module_of_its_own_and_the_model_ignores_it(checkpoint, rng):
    folder, reference = checkpoint
    config = _config(folder)
    tensors = _mtp_tensors(reference, rng)
    backend = MockGpuBackend()
    assert qwen3_next.load_mtp(config, SafetensorsWeights(folder), backend, 128) is None  # transformers wrote none
    mtp = qwen3_next.load_mtp(config, DictWeights(tensors), backend, 128)
    assert len(mtp.layers) == 1 and [group.layers for group in mtp.cache_groups] == [(0,)]
    assert mtp.layers[0].mixer.kinds | mtp.layers[0].feed_forward.kinds == {Kind.ATTENTION, Kind.DENSE, Kind.MOE}
    np.testing.assert_allclose(mtp.final_norm.weight, 1 + tensors["mtp.norm.weight"], rtol=1e-6)
    # fc over [norm_e(embedding) | norm_h(hidden)] is the two projections, the second added
    embedding, hidden = rng.standard_normal((2, 3, config.hidden_size)).astype(np.float32)
    out = backend.upload(np.zeros((3, config.hidden_size), np.float32))
    backend.dense.project(backend.upload(embedding), mtp.embedding_projection, out)
    backend.dense.project_add(backend.upload(hidden), mtp.hidden_projection, out)
    eps = config.rms_norm_eps
    joined = np.concatenate([rmsnorm(embedding, 1 + tensors["mtp.pre_fc_norm_embedding.weight"], eps),
                             rmsnorm(hidden, 1 + tensors["mtp.pre_fc_norm_hidden.weight"], eps)], axis=1)
    stored_fc = tensors["mtp.fc.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)  # the mock keeps bf16 weights
    np.testing.assert_allclose(backend.download(out), joined @ stored_fc.T, rtol=1e-4, atol=1e-4)
    model = load_model(config, DictWeights(tensors), MockGpuBackend(), 128)
    assert len(model.layers) == config.num_layers
    broken = {name: value for name, value in tensors.items() if name != "mtp.fc.weight"}
    with pytest.raises(WeightError, match="mtp.fc.weight"):
        qwen3_next.load_mtp(config, DictWeights(broken), backend, 128)
