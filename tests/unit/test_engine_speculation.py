"""Speculative decoding in the engine on a small random model: with the n-gram proposer the
tokens (and logprobs) are exactly those of plain decoding, greedy or seeded, with penalties,
stops, n > 1, chunked prefill, the prefix cache, preemption, decode graphs and token masks.

Point-mass drafts are verified against the target's own draws at counters c..c+k
(`accept_matching`), so equality is exact: these tests compare token for token. A bias toward a
few ids makes the random model repeat itself, so drafts are often accepted; plain rows mostly
reject them; both paths run.
"""

from __future__ import annotations

import pytest
from helpers.residue_grammar import follows_residues, residue_grammars, residues
from helpers.tiny_engine import VOCAB_SIZE, build_core, prompts, run

from atlas.domain.requests import Request, SamplingParams
from atlas.domain.speculative.config import SpeculativeConfig

NGRAM = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
REPEATING = {7: 6.0, 8: 6.0, 9: 5.5}  # a few ids dominate: the output repeats, drafts match

MIXES = [
    SamplingParams(temperature=0.0, max_tokens=30, logit_bias=REPEATING),
    SamplingParams(temperature=0.0, max_tokens=30),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=30, logit_bias=REPEATING),
    SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, repetition_penalty=1.05, logit_bias=REPEATING),
    SamplingParams(temperature=0.0, max_tokens=30, logit_bias=REPEATING, logprobs=2, min_tokens=10),
    SamplingParams(temperature=0.0, max_tokens=25, logit_bias=REPEATING, stop_token_ids=(9,)),
]


def requests_for(rng, count=12):
    return [Request(f"r{i}", p, MIXES[i % len(MIXES)], seed=31 + i) for i, p in enumerate(prompts(count, rng))]


def outputs(core, requests):
    """Tokens and logprobs of each request, invariants checked after every step."""
    tokens, logprobs = {r.request_id: [] for r in requests}, {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_unfinished:
        for output in core.step():
            tokens[output.seq_id].extend(output.new_token_ids)
            logprobs[output.seq_id].extend((lp.token_id, lp.logprob) for lp in output.logprobs)
        core.scheduler.check_invariants()
    return tokens, logprobs


def assert_same_outputs(got, expected):
    """Equal tokens; equal logprob ids, values to float32 rounding (batches of other shapes sum
    the logits in another order)."""
    assert got[0] == expected[0]
    for seq_id, pairs in expected[1].items():
        assert [t for t, _ in got[1][seq_id]] == [t for t, _ in pairs]
        assert [lp for _, lp in got[1][seq_id]] == pytest.approx([lp for _, lp in pairs], abs=1e-3)


@pytest.mark.parametrize("kwargs", [{}, {"budget": 24}, {"num_blocks": 40}, {"graph_sizes": (1, 2, 4, 8, 16, 32)}],
                         ids=["plain", "chunked-prefill", "preemption", "graphs"])
def test_ngram_speculation_gives_the_tokens_and_logprobs_of_plain_decoding(rng, kwargs):
    requests = requests_for(rng)
    expected = outputs(build_core(**kwargs), requests)
    core = build_core(speculative=NGRAM, **kwargs)
    assert_same_outputs(outputs(core, requests), expected)
    stats = core.stats()
    assert stats.num_spec_accepted_tokens > 20 and stats.num_spec_draft_tokens > stats.num_spec_accepted_tokens
    assert stats.num_generated_tokens == sum(len(t) for t in expected[0].values())
    assert stats.num_blocks_free == stats.num_blocks_total
    if "num_blocks" in kwargs:
        assert stats.num_preemptions > 0


def test_the_n_choices_of_a_request_speculate_each_on_their_own(rng):
    prompt = prompts(1, rng)[0]
    params = SamplingParams(temperature=0.9, max_tokens=30, logit_bias=REPEATING)
    choices = [Request(f"req-{i}", prompt, params, seed=500 + i) for i in range(4)]
    core = build_core(speculative=NGRAM)
    assert run(core, choices) == run(build_core(), choices)
    assert core.stats().num_spec_accepted_tokens > 0


def test_speculation_switches_off_above_disable_by_batch_size(rng):
    """With more running sequences than the threshold the steps overlap and draft nothing;
    as sequences finish the rest speculate. Tokens never change."""
    config = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                             "disable_by_batch_size": 3})
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, logit_bias=REPEATING),
                        seed=i) for i, p in enumerate(prompts(6, rng))]
    core = build_core(speculative=config)
    shapes = []
    original_submit = core.executor.submit

    def spying_submit(batch, before_launch=None):
        shapes.append((len(batch.sequences), any(s.num_draft_tokens for s in batch.sequences),
                       any(s.placeholder_row is not None for s in batch.sequences)))
        return original_submit(batch, before_launch)

    core.executor.submit = spying_submit
    assert run(core, requests) == run(build_core(), requests)
    assert not any(drafts for size, drafts, _ in shapes if size > 3)
    assert any(placeholders for size, _, placeholders in shapes if size > 3)  # those steps overlapped
    assert any(drafts for size, drafts, _ in shapes if size <= 3)


def test_steps_overlap_while_no_tail_ngram_has_occurred_before(rng):
    """Without a tail n-gram that occurred before (sizes 3..4, no bias: the random model rarely
    repeats itself) the steps overlap as plain decoding's do; a sequence whose tail repeats
    drafts again. Tokens never change."""
    config = SpeculativeConfig.from_mapping({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 3,
                                             "prompt_lookup_max": 4})
    params = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.0, max_tokens=24,
                                                                             logit_bias=REPEATING)]
    for mix, expect_drafts in ((params[:1], False), (params, True)):
        requests = [Request(f"r{i}", p, mix[i % len(mix)], seed=i) for i, p in enumerate(prompts(4, rng))]
        core = build_core(speculative=config)
        overlapped, drafted = [], []
        original_submit = core.executor.submit

        def spying_submit(batch, before_launch=None, original_submit=original_submit, overlapped=overlapped,
                          drafted=drafted):
            overlapped.append(any(s.placeholder_row is not None for s in batch.sequences))
            drafted.append(any(s.num_draft_tokens for s in batch.sequences))
            return original_submit(batch, before_launch)

        core.executor.submit = spying_submit
        assert run(core, requests) == run(build_core(), requests)
        assert sum(overlapped) > len(overlapped) // 3, overlapped
        assert any(drafted) == expect_drafts


def test_drafts_are_checked_against_each_sequence_grammar(rng):
    """Constrained sequences verify drafts under per-position masks (row j after drafts[:j]):
    the tokens follow the grammar and equal plain constrained decoding."""
    bias = {6: 4.0, 9: 4.0, 12: 4.0}  # ids 0 mod 3: drafts that match position 0 mod 3 only
    requests = [Request(f"r{i}", p, SamplingParams(temperature=t, max_tokens=30, logit_bias=bias), seed=i,
                        constraint=residues(24))
                for i, (p, t) in enumerate(zip(prompts(6, rng), (0.0, 0.8) * 3))]
    core = build_core(speculative=NGRAM, grammars=residue_grammars(VOCAB_SIZE))
    tokens = run(core, requests)
    assert tokens == run(build_core(grammars=residue_grammars(VOCAB_SIZE)), requests)
    assert all(follows_residues(t, 24) for t in tokens.values())
    assert core.stats().num_spec_draft_tokens > 0


def test_acceptance_reaches_the_metrics_endpoint(rng):
    from atlas.adapters.http.server_metrics import ServerMetrics

    core = build_core(speculative=NGRAM)
    run(core, requests_for(rng, 4))
    stats = core.stats()
    text = ServerMetrics(lambda: stats, lambda: True, lambda: 0).render()
    assert f"atlas_spec_decode_num_draft_tokens_total {stats.num_spec_draft_tokens}" in text
    assert f"atlas_spec_decode_num_accepted_tokens_total {stats.num_spec_accepted_tokens}" in text
    per_position = [line for line in text.splitlines()
                    if line.startswith("atlas_spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(per_position) == 4 and per_position[0].startswith('atlas_spec_decode_num_accepted_tokens_per_pos_total'
                                                                 '{position="0"} ')
    assert sum(int(line.split()[-1]) for line in per_position) == stats.num_spec_accepted_tokens
