"""Speculative decoding with a checkpoint's MTP layers (`{"method": "mtp"}`), on a tiny random
Qwen3-Next on the mock backend.

The head drafts greedily and the target verifies with `accept_matching`, so tokens and logprobs
equal plain decoding's, greedy or seeded. Two heads: the random one the checkpoint carries
(mostly rejected), and one made to predict as the target does (`copying_mtp`: every greedy
draft accepted), which fails if the head is fed the wrong tokens or positions. Both the
target's cache and the head's own pool must come back whole.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.draft_heads import build_mtp_core, copying_mtp, random_qwen3_next_weights
from helpers.draft_pools import assert_aborting_mid_stream_frees_the_pool, assert_all_blocks_back, checking_pool
from helpers.residue_grammar import follows_residues, residue_grammars, residues
from helpers.tiny_engine import prompts, run
from test_engine_speculation import REPEATING, assert_same_outputs, outputs, requests_for

from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.config import SpeculativeConfig

K = 3
MTP = SpeculativeConfig.from_mapping({"method": "mtp", "num_speculative_tokens": K})
RANDOM = random_qwen3_next_weights(seed=1)
COPYING = copying_mtp(RANDOM)


@pytest.mark.parametrize("weights", [RANDOM, COPYING], ids=["random-head", "copying-head"])
@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}, {"num_blocks": 40}, {"graph_sizes": (1, 2, 4, 8, 16, 32)}],
                         ids=["plain", "chunked-prefill", "preemption", "graphs"])
def test_mtp_gives_the_tokens_and_logprobs_of_plain_decoding(rng, weights, kwargs):
    requests = requests_for(rng)
    expected = outputs(build_mtp_core(weights, **kwargs), requests)
    core = build_mtp_core(weights, MTP, **kwargs)
    assert_same_outputs(outputs(checking_pool(core), requests), expected)
    stats = core.stats()
    assert stats.num_spec_verify_steps > 10 and stats.num_spec_draft_tokens > 0
    if weights is COPYING:
        assert stats.num_spec_accepted_tokens > stats.num_spec_draft_tokens // 2
    assert stats.num_generated_tokens == sum(len(t) for t in expected[0].values())
    assert_all_blocks_back(core)
    if "num_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_a_head_that_predicts_as_the_target_has_every_greedy_draft_accepted(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=31, ignore_eos=True), seed=i)
                for i, p in enumerate(prompts(5, rng))]
    core = build_mtp_core(COPYING, MTP)
    assert run(core, requests) == run(build_mtp_core(COPYING), requests)
    stats = core.stats()
    # the 30 tokens after the first come in 7 verify steps of K accepted drafts and the next token,
    # then one of a draft (room for 2 tokens)
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens == 5 * (7 * K + 1)
    assert stats.num_spec_verify_steps == 5 * 8
    assert_all_blocks_back(core)


def test_the_random_head_is_mostly_rejected_yet_changes_no_token(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30), seed=i)
                for i, p in enumerate(prompts(6, rng))]
    core = build_mtp_core(RANDOM, MTP)
    assert run(core, requests) == run(build_mtp_core(RANDOM), requests)
    stats = core.stats()
    assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


def test_the_n_choices_of_a_request_with_penalties_draft_each_on_their_own(rng):
    prompt = prompts(1, rng)[0]
    params = SamplingParams(temperature=0.9, max_tokens=30, logit_bias=REPEATING, presence_penalty=0.5)
    choices = [Request(f"req-{i}", prompt, params, seed=500 + i) for i in range(4)]
    core = build_mtp_core(COPYING, MTP)
    assert run(core, choices) == run(build_mtp_core(COPYING), choices)
    assert core.stats().num_spec_accepted_tokens > 0
    assert_all_blocks_back(core)


def test_aborting_mid_stream_frees_the_heads_blocks(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), seed=i)
                for i, p in enumerate(prompts(6, rng))]
    expected = run(build_mtp_core(COPYING), requests)
    core = build_mtp_core(COPYING, MTP)
    assert_aborting_mid_stream_frees_the_pool(core, requests, expected, aborted={"r1", "r4"}, at_step=4)


def test_a_head_pool_too_small_for_everyone_only_drafts_less(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20), seed=i)
                for i, p in enumerate(prompts(6, rng, low=10, high=20))]
    core = build_mtp_core(COPYING, MTP, head_blocks=12)
    assert run(core, requests) == run(build_mtp_core(COPYING), requests)
    assert core.stats().num_spec_accepted_tokens > 0 and core.stats().num_preemptions == 0
    assert_all_blocks_back(core)


def test_a_prefix_cache_hit_feeds_the_head_zero_hidden_states_and_changes_no_token():
    prompt = tuple(int(t) for t in np.random.default_rng(3).integers(0, 96, size=60))
    first = Request("first", prompt, SamplingParams(temperature=0.0, max_tokens=8), seed=1)
    second = Request("second", prompt, SamplingParams(temperature=0.0, max_tokens=16), seed=2)
    core = build_mtp_core(COPYING, MTP, budget=32)
    plain = build_mtp_core(COPYING, budget=32)
    assert run(core, [first]) == run(plain, [first])
    accepted_before = core.stats().num_spec_accepted_tokens
    assert run(core, [second]) == run(plain, [second])
    assert core.stats().num_prefix_cache_hits > 0
    assert core.stats().num_spec_accepted_tokens > accepted_before
    assert_all_blocks_back(core)


def test_constrained_sequences_verify_mtp_drafts_under_their_grammar(rng):
    bias = {6: 4.0, 9: 4.0, 12: 4.0}
    requests = [Request(f"r{i}", p, SamplingParams(temperature=t, max_tokens=30, logit_bias=bias), seed=i,
                        constraint=residues(24))
                for i, (p, t) in enumerate(zip(prompts(6, rng), (0.0, 0.8) * 3))]
    core = build_mtp_core(COPYING, MTP, grammars=residue_grammars(97))
    tokens = run(core, requests)
    assert tokens == run(build_mtp_core(COPYING, grammars=residue_grammars(97)), requests)
    assert all(follows_residues(t, 24) for t in tokens.values())
    assert core.stats().num_spec_accepted_tokens > 0
    assert_all_blocks_back(core)
