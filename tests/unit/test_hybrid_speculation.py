"""Speculative decoding on a hybrid model: a tiny random Qwen3-Next whose Gated DeltaNet layers
keep recurrent state beside an attention layer, on the mock backend.

A verify chunk runs as one sequence in the recurrent layers, writing the state after each inner
token into snapshot slots; after verification the state after the last kept token becomes the
sequence's slot. So greedy and seeded tokens (and logprobs) are plain decoding's, drafts are
accepted and rejected, and every block and state slot comes back. n-gram drafts (a bias makes
the random model repeat itself, so many are accepted) and the MTP head of the checkpoint (the
random one mostly rejected, the copying one always accepted).
"""

from __future__ import annotations

import pytest
from helpers.draft_heads import TINY_HYBRID_QWEN3_NEXT, build_mtp_core, copying_mtp, random_qwen3_next_weights
from helpers.tiny_engine import prompts, run
from test_engine_speculation import REPEATING, assert_same_outputs, outputs

from atlas.app.builder import check_speculation_fits
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.models.config import ModelConfig
from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.config import SpeculativeConfig
from atlas.adapters.mock.backend import MockGpuBackend

K = 3
NGRAM = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1})
MTP = SpeculativeConfig.from_mapping({"method": "mtp", "num_speculative_tokens": K})
RANDOM = random_qwen3_next_weights(TINY_HYBRID_QWEN3_NEXT, seed=3)
COPYING = copying_mtp(RANDOM, TINY_HYBRID_QWEN3_NEXT)

MIXES = [
    SamplingParams(temperature=0.0, max_tokens=24, logit_bias=REPEATING),
    SamplingParams(temperature=0.0, max_tokens=24),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=24, logit_bias=REPEATING),
    SamplingParams(temperature=0.0, max_tokens=20, logit_bias=REPEATING, logprobs=2, stop_token_ids=(9,)),
]


def hybrid_core(speculative=None, weights=RANDOM, **kwargs):
    return build_mtp_core(weights, speculative, shape=TINY_HYBRID_QWEN3_NEXT, **kwargs)


def requests_for(rng, count=6):
    return [Request(f"r{i}", p, MIXES[i % len(MIXES)], seed=11 + i) for i, p in enumerate(prompts(count, rng))]


def state_pool(core):
    [pool] = [group.pool for group in core.scheduler.cache.groups if not group.spec.kind.is_kv]
    return pool


def assert_everything_back(core):
    stats = core.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    pool = state_pool(core)
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}, {"num_blocks": 30, "max_num_seqs": 4}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_ngram_speculation_on_deltanet_layers_gives_the_tokens_of_plain_decoding(rng, kwargs):
    requests = requests_for(rng)
    expected = outputs(hybrid_core(**kwargs), requests)
    core = hybrid_core(NGRAM, **kwargs)
    assert_same_outputs(outputs(core, requests), expected)
    stats = core.stats()
    assert stats.num_spec_accepted_tokens > 10 and stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens
    assert stats.num_generated_tokens == sum(len(t) for t in expected[0].values())
    assert_everything_back(core)
    if "num_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_a_verify_step_gives_the_recurrent_layers_one_chunk_with_snapshot_slots(rng):
    """What the worker is handed: a sequence verifying K drafts names K snapshot slots of its
    state group, distinct from every slot in the step, and holds them only until the commit."""
    core = hybrid_core(NGRAM)
    seen = []
    original_submit = core.executor.submit

    def spying_submit(batch, before_launch=None):
        slots = [slot for seq in batch.sequences for slot in seq.state_slots]
        for seq in batch.sequences:
            if seq.num_draft_tokens:
                [snapshots] = seq.state_snapshots
                assert len(snapshots) == seq.num_draft_tokens and not set(snapshots) & set(slots)
                seen.append(snapshots)
            else:
                assert seq.state_snapshots == ()
        return original_submit(batch, before_launch)

    core.executor.submit = spying_submit
    params = SamplingParams(temperature=0.0, max_tokens=20, logit_bias=REPEATING)
    requests = [Request(f"r{i}", p, params, seed=i) for i, p in enumerate(prompts(3, rng))]
    assert run(core, requests) == run(hybrid_core(), requests)
    assert seen and all(len(s) == K for s in seen[:3])
    assert_everything_back(core)


@pytest.mark.parametrize("weights", [RANDOM, COPYING], ids=["random-head", "copying-head"])
@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}], ids=["plain", "chunked-prefill"])
def test_mtp_on_a_qwen3_next_with_deltanet_layers_gives_the_tokens_of_plain_decoding(rng, weights, kwargs):
    requests = requests_for(rng)
    expected = outputs(hybrid_core(weights=weights, **kwargs), requests)
    core = hybrid_core(MTP, weights, **kwargs)
    assert_same_outputs(outputs(core, requests), expected)
    stats = core.stats()
    assert stats.num_spec_verify_steps > 10
    if weights is COPYING:
        assert stats.num_spec_accepted_tokens > stats.num_spec_draft_tokens // 2
    else:
        assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert_everything_back(core)


def test_a_head_that_predicts_as_the_target_has_every_greedy_draft_accepted_through_the_deltanet_layers(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True), seed=i)
                for i, p in enumerate(prompts(4, rng))]
    core = hybrid_core(MTP, COPYING)
    assert run(core, requests) == run(hybrid_core(weights=COPYING), requests)
    stats = core.stats()
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens == 4 * (7 * K + 1)
    assert_everything_back(core)


def test_aborting_a_verifying_sequence_frees_its_snapshot_slots(rng):
    core = hybrid_core(MTP, COPYING)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts(4, rng)):
        core.add_request(Request(f"r{i}", prompt, params, seed=i))
    for step in range(200):
        if not core.has_unfinished:
            break
        if step == 5:
            core.abort("r1")
            core.abort("r2")
        core.step()
        core.scheduler.check_invariants()
    assert_everything_back(core)


def test_a_backend_without_state_snapshots_refuses_speculation_on_a_hybrid_model_naming_the_capability():
    class NoSnapshots(MockGpuBackend):
        @property
        def capabilities(self):
            caps = super().capabilities
            return type(caps)(caps.activation_dtype, caps.kv_dtypes, caps.kinds, caps.supports_graphs,
                              caps.device_name, state_snapshots=False)

    config = ModelConfig.from_dict(TINY_HYBRID_QWEN3_NEXT)
    settings = EngineSettings(model="tiny", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(SettingsError, match=r"^--speculative-config: .* \(Capabilities.state_snapshots\)") as caught:
        check_speculation_fits(settings, config, NoSnapshots())
    assert "\n" not in str(caught.value)
    check_speculation_fits(settings, config, MockGpuBackend())  # the mock writes them
    attention_only = ModelConfig.from_dict({**TINY_HYBRID_QWEN3_NEXT, "layer_types": ["full_attention"] * 3})
    check_speculation_fits(settings, attention_only, NoSnapshots())  # nothing recurrent to roll back
