"""Verification keeps the target's distribution: statistics on many seeded rows, plus exact cases.

The statistical tests bound the total-variation distance between the empirical distribution of
N verified tokens and the target's exact one. By the Bretagnolle-Huber-Carol inequality, N iid
draws over m categories give P(TV >= eps) <= 2**m * exp(-2 N eps**2), so with

    eps = sqrt((m ln 2 + ln(1 / delta)) / (2 N)),   delta = 1e-9,

a correct sampler fails with probability at most 1e-9 (the seeds are fixed: it passes or fails
the same way every run). Each case also shows the test has teeth: the distribution a plausible
bug would produce lies several eps away, and the samples are measurably far from it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from atlas.adapters.mock.sampler import sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.sampling import pack_rows, stream_keys, token_uniforms
from atlas.domain.speculative import VerifyOutcome, accept_matching, draft_seeds, race, rejection_sample, verify_drafts
from atlas.domain.speculative.verify import ACCEPT_TOKEN_ID, accept_uniforms

NUM_ROWS = 100_000
FAILURE_PROBABILITY = 1e-9
LOGITS = np.array([1.2, -0.4, 2.3, 0.9, 0.1, 2.0, -1.5, 1.7])
DRAFT_LOGITS = np.array([0.3, 1.1, 2.0, -0.5, 1.4, 0.2, 0.9, -1.0])


def tv_bound(num_samples: int, num_categories: int) -> float:
    return math.sqrt((num_categories * math.log(2) + math.log(1 / FAILURE_PROBABILITY)) / (2 * num_samples))


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def softmax(logits: np.ndarray) -> np.ndarray:
    weights = np.exp(logits - logits.max())
    return weights / weights.sum()


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    kept = np.zeros_like(probs)
    order = np.argsort(-probs, kind="stable")[:k]
    kept[order] = probs[order]
    return kept / kept.sum()


def top_p(probs: np.ndarray, mass: float) -> np.ndarray:
    order = np.argsort(-probs, kind="stable")
    preceding = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])
    kept = np.zeros_like(probs)
    kept[order[preceding < mass]] = probs[order[preceding < mass]]
    return kept / kept.sum()


def with_zeros(probs: np.ndarray, token_ids: list[int]) -> np.ndarray:
    kept = probs.copy()
    kept[token_ids] = 0
    return kept / kept.sum()


def recovered_from_target(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What a sampler that redraws from p (not the residual max(0, p - q)) after a rejection
    produces: accepted mass min(p, q), then the rejection mass spread as p."""
    overlap = np.minimum(p, q)
    return overlap + (1 - overlap.sum()) * p


def ignores_draft_probs(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """What accepting x with probability p(x) (treating a sampled draft as a point mass) gives."""
    accepted = q * p
    residual = np.maximum(p - q, 0)
    return accepted + (1 - accepted.sum()) * residual / residual.sum()


TARGET = softmax(LOGITS)
DRAFT = softmax(DRAFT_LOGITS)
# (p, q, the distribution a plausible bug would give instead, or None when every bug agrees)
SINGLE_POSITION_CASES = {
    "top-k target, dense draft": (top_k(TARGET, 3), DRAFT, recovered_from_target),
    "top-p target, draft with zeros where the target has mass": (
        top_p(TARGET, 0.8), with_zeros(DRAFT, [2, 5]), ignores_draft_probs,
    ),
    "top-5 target, draft mass on tokens the target never takes": (
        top_k(TARGET, 5), top_k(DRAFT, 5), recovered_from_target,
    ),
    "draft equal to the target": (top_p(TARGET, 0.9), top_p(TARGET, 0.9), None),
    "disjoint supports": (top_k(TARGET, 2), with_zeros(DRAFT, [2, 5]), None),
    "point-mass draft": (TARGET, np.eye(8)[0], recovered_from_target),
}  # fmt: skip


def first_tokens(p: np.ndarray, q: np.ndarray, num_drafts: int, seed_offset: int, coupled: bool = False) -> np.ndarray:
    """Verify `num_drafts` drafts drawn from q (same p, q at every position) on NUM_ROWS seeds;
    `coupled` drafts with the target's own seeds instead of `draft_seeds` (a bug)."""
    seeds = np.arange(NUM_ROWS, dtype=np.uint64) + np.uint64(seed_offset)
    counters = np.full(NUM_ROWS, 7)
    qs = np.tile(q.astype(np.float32), (NUM_ROWS, 1))
    drafting_seeds = seeds if coupled else draft_seeds(seeds)
    drafts = np.stack([race(qs, drafting_seeds, counters + j) for j in range(num_drafts)], axis=1)
    target_probs = np.broadcast_to(p.astype(np.float32), (NUM_ROWS, num_drafts + 1, len(p)))
    draft_probs = np.broadcast_to(q.astype(np.float32), (NUM_ROWS, num_drafts, len(q)))
    result = rejection_sample(target_probs, draft_probs, drafts, np.full(NUM_ROWS, num_drafts), seeds, counters)
    first = np.where(result.num_accepted > 0, drafts[:, 0], result.next_token_ids)
    return first


@pytest.mark.parametrize("case", list(SINGLE_POSITION_CASES))
def test_the_first_verified_token_follows_the_target(case: str) -> None:
    p, q, bug = SINGLE_POSITION_CASES[case]
    tokens = first_tokens(p, q, num_drafts=1, seed_offset=list(SINGLE_POSITION_CASES).index(case) << 40)
    empirical = np.bincount(tokens, minlength=len(p)) / NUM_ROWS
    bound = tv_bound(NUM_ROWS, len(p))
    assert total_variation(empirical, p) < bound, f"{case}: {empirical.round(4)} vs {p.round(4)}"
    assert not empirical[p == 0].any(), f"{case}: drew a token the target cannot produce"
    if bug is not None:
        wrong = bug(p, q)
        assert total_variation(wrong, p) > 4 * bound, f"{case}: the bug is too close to tell"
        assert total_variation(empirical, wrong) > 2 * bound, f"{case}: no teeth"


def test_drafts_drawn_with_the_targets_own_uniforms_are_caught() -> None:
    # Why the draft stream has its own seed: a draft raced on the same uniforms as the
    # correction is correlated with it, and the output drifts from the target.
    p, q, _ = SINGLE_POSITION_CASES["top-k target, dense draft"]
    tokens = first_tokens(p, q, num_drafts=1, seed_offset=0, coupled=True)
    empirical = np.bincount(tokens, minlength=len(p)) / NUM_ROWS
    assert total_variation(empirical, p) > 2 * tv_bound(NUM_ROWS, len(p))


def markov_chain(logits: np.ndarray, shift: int) -> np.ndarray:
    """[V, V]: row v is the next-token distribution after token v (top-3 truncated, so zeros)."""
    return np.stack([top_k(softmax(np.roll(logits, shift * v)), 3) for v in range(len(logits))])


TARGET_CHAIN = markov_chain(np.array([1.0, 0.2, -0.5, 0.7]), 1)
DRAFT_CHAIN = markov_chain(np.array([0.6, 0.9, -0.2, 0.1]), 3)


def generate(num_tokens: int, num_speculative: int, advance_counters: bool = True) -> np.ndarray:
    """[NUM_ROWS, num_tokens] tokens from the target chain, speculating with the draft chain.

    Every row starts after token 0 and runs the real loop: draft k tokens with the draft
    stream, verify them, append what passes, advance the counter by what was appended.
    """
    tokens = np.zeros((NUM_ROWS, num_tokens), dtype=np.int64)
    counts = np.zeros(NUM_ROWS, dtype=np.int64)
    seeds = np.arange(NUM_ROWS, dtype=np.uint64) * np.uint64(0x9E37) + np.uint64(11)
    rows = np.arange(NUM_ROWS)
    while (counts < num_tokens).any():
        previous = np.where(counts > 0, tokens[rows, np.maximum(counts - 1, 0)], 0)
        counters = counts if advance_counters else np.zeros_like(counts)
        contexts, drafts = [previous], []
        for j in range(num_speculative):
            drafts.append(race(DRAFT_CHAIN[contexts[-1]], draft_seeds(seeds), counters + j))
            contexts.append(drafts[-1])
        context = np.stack(contexts, axis=1)
        draft_ids = np.stack(drafts, axis=1)
        result = rejection_sample(
            TARGET_CHAIN[context], DRAFT_CHAIN[context[:, :-1]], draft_ids,
            np.full(NUM_ROWS, num_speculative), seeds, counters,
        )  # fmt: skip
        # Row r appends drafts[:a] then next: position i holds a draft below a, next at a.
        for position in range(num_speculative + 1):
            token = draft_ids[:, min(position, num_speculative - 1)] if num_speculative else result.next_token_ids
            token = np.where(position == result.num_accepted, result.next_token_ids, token)
            appends = (position <= result.num_accepted) & (counts < num_tokens)
            tokens[rows[appends], counts[appends]] = token[appends]
            counts += appends
    return tokens


def sequence_distribution(chain: np.ndarray, num_tokens: int) -> np.ndarray:
    """Exact probabilities of every token sequence of length `num_tokens` after token 0."""
    vocab_size = chain.shape[0]
    probs = chain[0]  # over sequences coded base V, the last token in the lowest digit
    for _ in range(num_tokens - 1):
        probs = (probs[:, None] * chain[np.arange(probs.size) % vocab_size]).reshape(-1)
    return probs


def sequence_histogram(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    codes = np.zeros(len(tokens), dtype=np.int64)
    for column in tokens.T:
        codes = codes * vocab_size + column
    return np.bincount(codes, minlength=vocab_size ** tokens.shape[1]) / len(tokens)


def test_speculated_sequences_follow_the_target_chain_over_several_steps() -> None:
    # k = 3 drafts a step, 4 tokens: sequences cross step boundaries at every possible place,
    # so acceptance, correction, bonus and the counter's advance all shape the joint law.
    tokens = generate(num_tokens=4, num_speculative=3)
    vocab_size = TARGET_CHAIN.shape[0]
    empirical = sequence_histogram(tokens, vocab_size)
    exact = sequence_distribution(TARGET_CHAIN, 4)
    bound = tv_bound(NUM_ROWS, exact.size)
    assert total_variation(empirical, exact) < bound
    assert total_variation(empirical, sequence_distribution(DRAFT_CHAIN, 4)) > 4 * bound  # teeth


def test_reusing_the_counter_across_steps_is_caught() -> None:
    # The plausible integration bug: every step starts its draws at counter 0, so a step reuses
    # the uniforms that judged the previous one. The same statistic sees it.
    tokens = generate(num_tokens=4, num_speculative=1, advance_counters=False)
    exact = sequence_distribution(TARGET_CHAIN, 4)
    empirical = sequence_histogram(tokens, TARGET_CHAIN.shape[0])
    assert total_variation(empirical, exact) > 2 * tv_bound(NUM_ROWS, exact.size)


def generate_with_greedy_drafts(num_tokens: int, num_speculative: int, accept_in_support: bool = False) -> np.ndarray:
    """[NUM_ROWS, num_tokens] tokens from the target chain, drafting as the draft_model proposer
    does: the draft chain's argmax, k times, verified by `accept_matching` against the target's
    ordinary draws at counters c..c+k. `accept_in_support` accepts a draft whenever the target
    can produce it instead (a plausible bug)."""
    tokens = np.zeros((NUM_ROWS, num_tokens), dtype=np.int64)
    counts = np.zeros(NUM_ROWS, dtype=np.int64)
    seeds = np.arange(NUM_ROWS, dtype=np.uint64) * np.uint64(0x9E37) + np.uint64(29)
    rows = np.arange(NUM_ROWS)
    while (counts < num_tokens).any():
        previous = np.where(counts > 0, tokens[rows, np.maximum(counts - 1, 0)], 0)
        contexts = [previous]
        for _ in range(num_speculative):
            contexts.append(np.argmax(DRAFT_CHAIN[contexts[-1]], axis=1))
        context = np.stack(contexts, axis=1)
        draft_ids = context[:, 1:]
        target_ids = np.stack([race(TARGET_CHAIN[context[:, j]], seeds, counts + j)
                               for j in range(num_speculative + 1)], axis=1)
        if accept_in_support:
            in_support = TARGET_CHAIN[context[:, :-1], draft_ids] > 0
            target_ids[:, :-1] = np.where(in_support, draft_ids, target_ids[:, :-1])
        result = accept_matching(target_ids, draft_ids, np.full(NUM_ROWS, num_speculative))
        for position in range(num_speculative + 1):
            token = np.where(position == result.num_accepted, result.next_token_ids,
                             draft_ids[:, min(position, num_speculative - 1)])
            appends = (position <= result.num_accepted) & (counts < num_tokens)
            tokens[rows[appends], counts[appends]] = token[appends]
            counts += appends
    return tokens


def test_greedy_draft_model_proposals_keep_the_target_chain_over_several_steps() -> None:
    # The draft_model proposer's drafts are a deterministic function of the context (the draft's
    # argmax), independent of the target's uniforms: accepting the ones the target draws itself
    # leaves every token the target's draw, whatever the draft model says.
    tokens = generate_with_greedy_drafts(num_tokens=4, num_speculative=3)
    exact = sequence_distribution(TARGET_CHAIN, 4)
    bound = tv_bound(NUM_ROWS, exact.size)
    assert total_variation(sequence_histogram(tokens, TARGET_CHAIN.shape[0]), exact) < bound
    wrong = sequence_histogram(generate_with_greedy_drafts(4, 3, accept_in_support=True), TARGET_CHAIN.shape[0])
    assert total_variation(wrong, exact) > 4 * bound  # teeth: the bug is far, and the statistic sees it


# -- point-mass drafts: the target's own draws, so the tokens equal plain decoding's ---------


VOCAB_LOGITS = np.random.default_rng(5).normal(0, 1.5, size=(6, 6)).astype(np.float32)  # next-token logits per token


def sampling_row(seed: int, counter: int, temperature: float) -> SamplingRow:
    return SamplingRow(temperature=temperature, top_k=4, top_p=0.9, min_p=0.0, seed=seed, counter=counter)


def plain_decode(seed: int, num_tokens: int, temperature: float) -> list[int]:
    tokens = [0]
    for counter in range(num_tokens):
        packed = pack_rows([sampling_row(seed, counter, temperature)])
        tokens.append(int(sample_rows(VOCAB_LOGITS[tokens[-1]][None], packed, None).token_ids[0]))
    return tokens[1:]


def speculative_decode(seed: int, num_tokens: int, temperature: float, drafter: np.random.Generator) -> list[int]:
    tokens = [0]
    while len(tokens) - 1 < num_tokens:
        greedy_guess = int(np.argmax(VOCAB_LOGITS[tokens[-1]]))
        drafts = [greedy_guess if drafter.random() < 0.6 else int(drafter.integers(6)) for _ in range(3)]
        contexts = [tokens[-1], *drafts]
        counter = len(tokens) - 1
        packed = pack_rows([sampling_row(seed, counter + j, temperature) for j in range(4)])
        target_ids = sample_rows(VOCAB_LOGITS[contexts], packed, None).token_ids
        result = accept_matching(target_ids[None], np.array([drafts]), np.array([3]))
        tokens.extend(result.outcomes(np.array([drafts]), np.array([3]))[0].token_ids)
    return tokens[1 : num_tokens + 1]


@pytest.mark.parametrize("temperature", [0.0, 0.8, 1.5])
def test_point_mass_drafts_reproduce_plain_decoding_token_for_token(temperature: float) -> None:
    drafter = np.random.default_rng(17)
    for seed in (3, 2**64 - 5, 123456789):
        assert speculative_decode(seed, 24, temperature, drafter) == plain_decode(seed, 24, temperature)


# -- exact cases -------------------------------------------------------------------------------


def test_greedy_acceptance_stops_at_the_first_mismatch_and_ignores_padding() -> None:
    target_ids = np.array([[5, 6, 7, 8], [5, 9, 7, 8], [4, 4, 4, 4], [1, 2, 3, 4], [9, 9, 9, 9]])
    draft_ids = np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 2, 99], [0, 0, 0]])
    num_drafts = np.array([3, 3, 3, 2, 0])
    result = accept_matching(target_ids, draft_ids, num_drafts)
    assert result.num_accepted.tolist() == [3, 1, 0, 2, 0]
    assert result.next_token_ids.tolist() == [8, 9, 4, 3, 9]
    outcomes = result.outcomes(draft_ids, num_drafts)
    assert [o.token_ids for o in outcomes] == [(5, 6, 7, 8), (5, 9), (4,), (1, 2, 3), (9,)]
    assert [o.num_rolled_back for o in outcomes] == [0, 2, 3, 0, 0]


def test_a_greedy_target_under_rejection_sampling_accepts_exactly_its_argmax() -> None:
    p = np.eye(5, dtype=np.float32)[[3, 1, 4]][None]  # one-hot targets: argmax 3, 1, 4
    q = np.full((1, 2, 5), 0.2, dtype=np.float32)
    for drafts, accepted, next_token in (([3, 1], 2, 4), ([3, 2], 1, 1), ([0, 1], 0, 3)):
        result = rejection_sample(p, q, np.array([drafts]), np.array([2]), np.array([42]), np.array([0]))
        assert (int(result.num_accepted[0]), int(result.next_token_ids[0])) == (accepted, next_token)


def splitmix_uniform(key: int, token_id: int) -> float:
    """The contract's U(key, i) in plain Python integers, written from the docstring."""
    mask = (1 << 64) - 1
    x = (key ^ (token_id * 0xD1B54A32D192ED03)) & mask
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return ((x >> 41) + 0.5) * 2.0**-23


def test_the_acceptance_uniform_and_draft_seed_are_the_documented_bits() -> None:
    seed, counter = 0xDEADBEEF12345678, 9
    key = seed ^ ((counter * 0x9E3779B97F4A7C15) & ((1 << 64) - 1))
    assert float(accept_uniforms(np.array([seed], np.uint64), np.array([counter]))[0]) == splitmix_uniform(key, 2**32)
    assert ACCEPT_TOKEN_ID == 2**32
    assert int(draft_seeds(np.array([seed], np.uint64))[0]) == seed ^ (1 << 63)
    # The race uses the ordinary sampler's uniforms of the same key.
    uniforms = token_uniforms(stream_keys(np.array([seed], np.uint64), np.array([counter])), np.arange(3, dtype=np.uint64))
    assert [float(u) for u in uniforms] == [splitmix_uniform(key, v) for v in range(3)]


def test_the_race_draws_like_the_mock_sampler_over_the_same_distribution() -> None:
    # Same uniforms, same Gumbel-max rule: over log-probabilities the winner is the sampler's
    # winner over logits wherever no near-tie makes float rounding matter.
    seeds = np.arange(2000, dtype=np.uint64)
    probs = np.tile(softmax(LOGITS.astype(np.float32)).astype(np.float32), (2000, 1))
    drawn = race(probs, seeds, np.zeros(2000, np.int64))
    rows = [SamplingRow(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=int(s), counter=0) for s in seeds]
    sampled = sample_rows(np.tile(LOGITS.astype(np.float32), (2000, 1)), pack_rows(rows), None).token_ids
    assert np.mean(drawn == sampled) > 0.995


def test_rows_with_nothing_drafted_get_the_bonus_draw_from_the_target() -> None:
    p = np.tile(top_k(TARGET, 3).astype(np.float32), (4, 2, 1))
    q = np.tile(DRAFT.astype(np.float32), (4, 1, 1))
    seeds, counters = np.arange(4, dtype=np.uint64), np.array([0, 1, 2, 3])
    result = rejection_sample(p, q, np.zeros((4, 1), np.int64), np.zeros(4, np.int64), seeds, counters)
    assert result.num_accepted.tolist() == [0, 0, 0, 0]
    assert result.next_token_ids.tolist() == race(p[:, 0], seeds, counters).tolist()


@pytest.mark.parametrize(
    ("draft_ids", "num_drafts", "message"),
    [
        (np.zeros((2, 3)), np.array([1, 1]), "draft_ids"),
        (np.zeros((2, 2)), np.array([1, 3]), "num_drafts"),
        (np.full((2, 2), 8), np.array([2, 2]), "draft_ids"),
    ],
)
def test_inconsistent_inputs_are_refused(draft_ids: np.ndarray, num_drafts: np.ndarray, message: str) -> None:
    p = np.full((2, 3, 8), 1 / 8, dtype=np.float32)
    q = np.full((2, 2, 8), 1 / 8, dtype=np.float32)
    with pytest.raises(ValueError, match=message):
        rejection_sample(p, q, draft_ids, num_drafts, np.zeros(2, np.uint64), np.zeros(2, np.int64))


def test_an_outcome_cut_by_a_stop_rolls_back_the_rest() -> None:
    outcome = VerifyOutcome((11, 12, 13), num_drafts=4)
    assert (outcome.num_accepted, outcome.num_rolled_back) == (2, 2)
    cut = outcome.keep(1)
    assert (cut.token_ids, cut.num_rolled_back) == ((11,), 4)
    with pytest.raises(ValueError):
        outcome.keep(4)
    with pytest.raises(ValueError):
        VerifyOutcome((1, 2, 3), num_drafts=1)


def test_the_engines_row_by_row_verification_agrees_with_accept_matching() -> None:
    """`verify_drafts` (what the scheduler's commit runs over ragged rows) against the array
    rule, on random rows whose drafts match the draws for a random length, then diverge."""
    rng = np.random.default_rng(3)
    drafts, targets = [], []
    for _ in range(200):
        num_drafts = int(rng.integers(0, 7))
        row_targets = [int(t) for t in rng.integers(0, 5, size=num_drafts + 1)]
        matching = int(rng.integers(0, num_drafts + 1))
        row_drafts = row_targets[:matching] + [int(t) for t in rng.integers(0, 5, size=num_drafts - matching)]
        drafts.append(row_drafts)
        targets.append(row_targets)
    width = max(len(row) for row in drafts)
    draft_ids = np.array([row + [0] * (width - len(row)) for row in drafts])
    target_ids = np.array([row + [0] * (width + 1 - len(row)) for row in targets])
    num_drafts = np.array([len(row) for row in drafts])
    expected = accept_matching(target_ids, draft_ids, num_drafts).outcomes(draft_ids, num_drafts)
    assert verify_drafts(drafts, targets) == expected
    assert {outcome.num_accepted for outcome in expected} >= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="row 0: 2 draws for 2 drafts"):
        verify_drafts([[1, 2]], [[1, 2]])
