"""Chi-square goodness of fit: the sampler draws from the distribution each rule defines.

Each case draws many tokens from one fixed row of logits over a small vocabulary, one draw
per counter of the random stream, and compares the counts with the exact distribution the
rules define, computed here in float64 without the sampler's code. The p-value comes from the
chi-square survival function computed below (scipy is not a dependency). Each case also
checks the test has teeth: the same counts against the distribution of a plausible wrong
implementation give an overwhelming statistic.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from atlas.adapters.mock.sampler import sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.sampling import pack_rows

NUM_DRAWS = 20_000
SIGNIFICANCE = 1e-3
LOGITS = np.float32([1.2, -0.4, 2.3, 0.9, 0.1, 2.0, -1.5, 1.7, 0.4, -0.8, 1.1, 2.6])


def chi_square_survival(statistic: float, degrees_of_freedom: int) -> float:
    """P(X >= statistic) for X ~ chi-square(dof): 1 - the regularised lower incomplete gamma
    P(dof / 2, statistic / 2), summed as its power series (it converges for every x)."""
    a, x = degrees_of_freedom / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > total * 1e-17:
        n += 1
        term *= x / (a + n)
        total += term
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


@pytest.mark.parametrize(
    ("statistic", "dof", "p_value"),
    # Textbook critical values of the chi-square distribution.
    [(10.828, 1, 1e-3), (3.841, 1, 0.05), (29.588, 10, 1e-3), (18.307, 10, 0.05), (32.909, 12, 1e-3)],
)
def test_chi_square_survival_matches_tables(statistic: float, dof: int, p_value: float) -> None:
    assert chi_square_survival(statistic, dof) == pytest.approx(p_value, rel=2e-3)


def goodness_of_fit(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """The chi-square p-value of `counts` under `expected_probs`; 0 when a token of
    probability 0 was drawn (no amount of luck explains that).

    Categories expecting fewer than 5 draws are pooled into one, as the chi-square
    approximation needs.
    """
    possible = expected_probs > 0
    if counts[~possible].any():
        return 0.0
    expected = expected_probs[possible] * counts.sum()
    observed = counts[possible].astype(np.float64)
    order = np.argsort(expected)
    num_pooled = int(np.searchsorted(np.cumsum(expected[order]), 5.0, side="right"))
    if 0 < num_pooled < len(order) and expected[order[0]] < 5:
        num_pooled += 1  # the pool itself must expect at least 5
        pooled = order[:num_pooled]
        kept = order[num_pooled:]
        expected = np.append(expected[kept], expected[pooled].sum())
        observed = np.append(observed[kept], observed[pooled].sum())
    statistic = float((((observed - expected) ** 2) / expected).sum())
    return chi_square_survival(statistic, len(expected) - 1)


def exact_distribution(
    logits: np.ndarray,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    bias: dict[int, float] | None = None,
) -> np.ndarray:
    """The rules of `SamplingTensors` in float64, by a full sort."""
    wide = logits.astype(np.float64)
    for token_id, value in (bias or {}).items():
        wide[token_id] += value
    order = np.argsort(-wide, kind="stable")  # descending, ties: lowest id
    if top_k:
        order = order[:top_k]
    scaled = wide[order] / temperature
    relative = np.exp(scaled - scaled.max())
    probs = relative / relative.sum()
    preceding = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    assert top_p == 1.0 or np.abs(preceding - top_p).min() > 1e-4, "top_p too close to a cumulative mass"
    keep = (preceding < top_p) & (relative >= min_p)
    result = np.zeros(len(logits))
    result[order[keep]] = relative[keep] / relative[keep].sum()
    return result


def draw_counts(
    logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
    bias: dict[int, float] | None = None, seed: int = 20240601,
) -> np.ndarray:  # fmt: skip
    bias = bias or {}
    rows = [
        SamplingRow(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, counter=counter,
                    bias_token_ids=tuple(bias), bias_values=tuple(bias.values()))
        for counter in range(NUM_DRAWS)
    ]  # fmt: skip
    token_ids = sample_rows(np.tile(logits, (NUM_DRAWS, 1)), pack_rows(rows), None).token_ids
    return np.bincount(token_ids, minlength=len(logits))


CASES = {
    "temperature 0.5": dict(temperature=0.5),
    "temperature 1": dict(temperature=1.0),
    "temperature 2": dict(temperature=2.0),
    "top-k 4": dict(temperature=1.0, top_k=4),
    "top-k 7, temperature 1.5": dict(temperature=1.5, top_k=7),
    "top-p 0.6": dict(temperature=1.0, top_p=0.6),
    "top-p 0.9, temperature 2": dict(temperature=2.0, top_p=0.9),
    "min-p 0.2": dict(temperature=1.0, min_p=0.2),
    "min-p 0.05, temperature 0.7": dict(temperature=0.7, min_p=0.05),
    "top-k 7, top-p 0.85, min-p 0.2": dict(temperature=1.0, top_k=7, top_p=0.85, min_p=0.2),
    "bias": dict(temperature=1.0, bias={6: 3.0, 11: -1.0, 2: float("-inf")}),
}
# What a plausible bug would sample instead of each case.
WRONG = {
    "temperature 0.5": dict(temperature=1.0),
    "temperature 1": dict(temperature=0.8),
    "temperature 2": dict(temperature=1.0),
    "top-k 4": dict(temperature=1.0, top_k=5),
    "top-k 7, temperature 1.5": dict(temperature=1.0, top_k=7),
    "top-p 0.6": dict(temperature=1.0, top_p=0.75),
    "top-p 0.9, temperature 2": dict(temperature=1.0, top_p=0.9),
    "min-p 0.2": dict(temperature=1.0, min_p=0.3),
    "min-p 0.05, temperature 0.7": dict(temperature=1.0, min_p=0.05),
    # top-p over the whole vocabulary instead of the renormalised top-k set
    "top-k 7, top-p 0.85, min-p 0.2": dict(temperature=1.0, top_p=0.85, min_p=0.2),
    "bias": dict(temperature=1.0, bias={11: -1.0, 2: float("-inf")}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_samples_follow_the_exact_distribution(case: str) -> None:
    counts = draw_counts(LOGITS, **CASES[case])
    p_value = goodness_of_fit(counts, exact_distribution(LOGITS, **CASES[case]))
    assert p_value > SIGNIFICANCE, f"{case}: p = {p_value:.2e}, counts {counts.tolist()}"
    assert goodness_of_fit(counts, exact_distribution(LOGITS, **WRONG[case])) < 1e-12, f"{case}: no teeth"


def test_filters_leave_out_exactly_the_expected_tokens() -> None:
    # A filter that keeps one token too many would show up as a drawn impossible token.
    for case in ("top-k 4", "top-p 0.6", "min-p 0.2", "top-k 7, top-p 0.85, min-p 0.2"):
        counts = draw_counts(LOGITS, **CASES[case])
        expected = exact_distribution(LOGITS, **CASES[case])
        assert np.array_equal(counts > 0, expected > 0), case


def test_other_seeds_give_the_same_distribution() -> None:
    expected = exact_distribution(LOGITS, temperature=1.0, top_k=6)
    for seed in (1, 2**64 - 1):
        counts = draw_counts(LOGITS, temperature=1.0, top_k=6, seed=seed)
        assert goodness_of_fit(counts, expected) > SIGNIFICANCE
