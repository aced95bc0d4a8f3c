"""Speculative decoding with a draft model in the engine, on small random models (mock backend).

The draft drafts greedily and the target verifies with `accept_matching`, so the tokens (and
logprobs) equal plain decoding's token for token, greedy or seeded: these tests compare exactly.
Two drafts: another random model sharing the vocabulary (one layer, other weights: mostly
rejected) and the target itself (every greedy draft accepted). Both the target's cache and the
draft's own pool must come back whole.
"""

from __future__ import annotations

import numpy as np
import pytest
from fakes import TINY_LLAMA
from helpers.draft_pools import assert_aborting_mid_stream_frees_the_pool, assert_all_blocks_back, checking_pool
from helpers.residue_grammar import follows_residues, residue_grammars, residues
from helpers.tiny_engine import VOCAB_SIZE, build_core, prompts, run
from test_engine_speculation import REPEATING, assert_same_outputs, outputs, requests_for

from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.config import SpeculativeConfig

K = 4
DRAFT_MODEL = SpeculativeConfig.from_mapping({"method": "draft_model", "num_speculative_tokens": K, "model": "draft"})
SMALL_DRAFT = ({**TINY_LLAMA, "num_hidden_layers": 1}, 7)  # another model over the same vocabulary
DRAFTS = {"other-model": SMALL_DRAFT, "target-itself": "target"}


@pytest.mark.parametrize("draft", DRAFTS.values(), ids=DRAFTS.keys())
@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}, {"num_blocks": 40}, {"graph_sizes": (1, 2, 4, 8, 16, 32)}],
                         ids=["plain", "chunked-prefill", "preemption", "graphs"])
def test_a_draft_model_gives_the_tokens_and_logprobs_of_plain_decoding(rng, draft, kwargs):
    requests = requests_for(rng)
    expected = outputs(build_core(**kwargs), requests)
    core = build_core(speculative=DRAFT_MODEL, draft=draft, **kwargs)
    assert_same_outputs(outputs(checking_pool(core), requests), expected)
    stats = core.stats()
    assert stats.num_spec_verify_steps > 10 and stats.num_spec_accepted_tokens > 0
    assert stats.num_generated_tokens == sum(len(t) for t in expected[0].values())
    assert_all_blocks_back(core)
    if "num_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_the_target_as_its_own_draft_has_every_greedy_draft_accepted(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=41), seed=i)
                for i, p in enumerate(prompts(6, rng))]
    core = build_core(speculative=DRAFT_MODEL, draft="target")
    assert run(core, requests) == run(build_core(), requests)
    stats = core.stats()
    # the 40 tokens after the first come in 8 verify steps of K accepted drafts and the next token
    assert stats.num_spec_accepted_tokens == stats.num_spec_draft_tokens == 6 * 8 * K
    assert stats.num_spec_verify_steps == 6 * 8 and stats.spec_accepted_by_position == (6 * 8,) * K
    assert_all_blocks_back(core)


def test_a_different_draft_is_mostly_rejected_yet_changes_no_token(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=30), seed=i)
                for i, p in enumerate(prompts(6, rng))]
    core = build_core(speculative=DRAFT_MODEL, draft=SMALL_DRAFT)
    assert run(core, requests) == run(build_core(), requests)
    stats = core.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens


def test_the_n_choices_of_a_request_draft_each_on_their_own(rng):
    prompt = prompts(1, rng)[0]
    params = SamplingParams(temperature=0.9, max_tokens=30, logit_bias=REPEATING)
    choices = [Request(f"req-{i}", prompt, params, seed=500 + i) for i in range(4)]
    core = build_core(speculative=DRAFT_MODEL, draft="target")
    assert run(core, choices) == run(build_core(), choices)
    assert core.stats().num_spec_accepted_tokens > 0
    assert_all_blocks_back(core)


def test_aborting_mid_stream_frees_the_drafts_blocks_and_leaves_the_others_untouched(rng):
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=40), seed=i)
                for i, p in enumerate(prompts(6, rng))]
    expected = run(build_core(), requests)
    core = build_core(speculative=DRAFT_MODEL, draft="target")
    assert_aborting_mid_stream_frees_the_pool(core, requests, expected, aborted={"r1", "r4"}, at_step=6)


def test_a_draft_pool_too_small_for_everyone_only_drafts_less(rng):
    """Draft blocks run short (a pool of 12 blocks of 4 tokens for 6 sequences): the sequences
    without blocks go undrafted, nobody is preempted for the draft, tokens stay the same."""
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=20), seed=i)
                for i, p in enumerate(prompts(6, rng, low=10, high=20))]
    core = build_core(speculative=DRAFT_MODEL, draft="target", draft_blocks=12)
    assert run(core, requests) == run(build_core(), requests)
    assert core.stats().num_spec_accepted_tokens > 0 and core.stats().num_preemptions == 0
    assert_all_blocks_back(core)


def test_seeded_sampled_rows_follow_the_targets_distribution_draw_for_draw(rng):
    """The output distribution with a draft model is the target's: every seeded draw is the one
    plain decoding makes (a stronger statement than a statistical test, which
    `test_speculative_verify` runs on the acceptance rule itself). Here over 64 seeds of one
    prompt, whose first tokens also spread over several ids."""
    prompt = prompts(1, rng)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6, logit_bias=REPEATING)
    requests = [Request(f"s{seed}", prompt, params, seed=seed) for seed in range(64)]
    core = build_core(speculative=DRAFT_MODEL, draft="target", max_num_seqs=64)
    tokens = run(core, requests)
    assert tokens == run(build_core(max_num_seqs=64), requests)
    assert len({t[1] for t in tokens.values()}) > 2
    assert core.stats().num_spec_accepted_tokens > 0


def test_a_draft_round_catches_up_over_prefix_cache_hits(rng):
    """A prompt resumed from the prefix cache was never computed by the draft: its round catches
    up from position 0 (over steps when the budget is short) before drafting."""
    prompt = tuple(int(t) for t in np.random.default_rng(3).integers(0, 96, size=60))
    first = Request("first", prompt, SamplingParams(temperature=0.0, max_tokens=8), seed=1)
    second = Request("second", prompt, SamplingParams(temperature=0.0, max_tokens=16), seed=2)
    core = build_core(speculative=DRAFT_MODEL, draft="target", budget=32)
    plain = build_core(budget=32)
    assert run(core, [first]) == run(plain, [first])
    accepted_before = core.stats().num_spec_accepted_tokens
    assert run(core, [second]) == run(plain, [second])
    assert core.stats().num_prefix_cache_hits > 0
    assert core.stats().num_spec_accepted_tokens > accepted_before
    assert_all_blocks_back(core)


def test_constrained_sequences_verify_draft_model_drafts_under_their_grammar(rng):
    bias = {6: 4.0, 9: 4.0, 12: 4.0}
    requests = [Request(f"r{i}", p, SamplingParams(temperature=t, max_tokens=30, logit_bias=bias), seed=i,
                        constraint=residues(24))
                for i, (p, t) in enumerate(zip(prompts(6, rng), (0.0, 0.8) * 3))]
    core = build_core(speculative=DRAFT_MODEL, draft="target", grammars=residue_grammars(VOCAB_SIZE))
    tokens = run(core, requests)
    assert tokens == run(build_core(grammars=residue_grammars(VOCAB_SIZE)), requests)
    assert all(follows_residues(t, 24) for t in tokens.values())
    assert core.stats().num_spec_accepted_tokens > 0
    assert_all_blocks_back(core)
