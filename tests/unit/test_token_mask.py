"""The bitmask layout and its numpy reference, and how it composes with the mock sampler."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.adapters.mock.sampler import sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.reasoning_budget import ReasoningMarkers, reasoning_markers, thinking_budget_tokens
from atlas.domain.requests import ParameterError
from atlas.domain.sampling import pack_rows
from atlas.domain.token_mask import allow, allow_only, allowed_bits, apply_token_bitmask, bitmask_width


def test_bits_map_to_token_ids_across_words() -> None:
    row = np.zeros(bitmask_width(70), dtype=np.int32)
    allow_only(row, [0, 31, 32, 69])
    assert row.tolist() == [np.int32(np.uint32(1 | 1 << 31).view(np.int32)), 1, 1 << 5]
    assert np.flatnonzero(allowed_bits(row, 70)).tolist() == [0, 31, 32, 69]
    allow(row, [5])
    assert np.flatnonzero(allowed_bits(row, 70)).tolist() == [0, 5, 31, 32, 69]


def test_disallowed_logits_become_minus_infinity(rng: np.random.Generator) -> None:
    logits = rng.standard_normal((3, 70)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    bitmask[:, -1] |= -1 << 6  # bits past token 69 are padding: set them, they must be ignored
    masked = apply_token_bitmask(logits, bitmask)
    for r in range(3):
        for v in range(70):
            bit = (int(bitmask[r, v // 32]) >> (v % 32)) & 1
            assert masked[r, v] == (logits[r, v] if bit else -np.inf)
    assert not np.shares_memory(masked, logits)


def test_bad_masks_are_refused() -> None:
    logits = np.zeros((2, 40), dtype=np.float32)
    with pytest.raises(ValueError, match=r"bitmask: expected int32 \[2, 2\]"):
        apply_token_bitmask(logits, np.zeros((2, 1), dtype=np.int32))
    bitmask = np.full((2, 2), -1, dtype=np.int32)
    bitmask[1] = [0, -1 << 8]  # only padding bits past token 39
    with pytest.raises(ValueError, match=r"rows \[1\] allow no token"):
        apply_token_bitmask(logits, bitmask)


def test_the_sampler_never_draws_a_masked_token(rng: np.random.Generator) -> None:
    """Masking before the sampler's rules (penalties, bias, temperature, top-p, the race) keeps
    every draw inside the mask: -inf stays -inf through each of them."""
    vocab_size = 100
    logits = rng.standard_normal((4, vocab_size)).astype(np.float32) * 3
    bitmask = np.zeros((4, bitmask_width(vocab_size)), dtype=np.int32)
    allowed_ids = [[3, 50], [99], [0, 1, 2, 64], [7]]
    for row, ids in zip(bitmask, allowed_ids):
        allow_only(row, ids)
    masked = apply_token_bitmask(logits, bitmask)
    for counter in range(50):
        rows = [SamplingRow(temperature=t, top_k=0, top_p=p, min_p=0.0, seed=11, counter=counter,
                            repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.0,
                            penalty_token_ids=(3, 99), penalty_output_counts=(1, 0), bias_token_ids=(50,),
                            bias_values=(2.0,), num_logprobs=None)
                for t, p in ((1.0, 1.0), (0.0, 1.0), (1.5, 0.9), (0.7, 0.5))]
        drawn = sample_rows(masked, pack_rows(rows), None).token_ids
        assert all(int(token) in ids for token, ids in zip(drawn, allowed_ids))


def test_thinking_budgets_from_each_api() -> None:
    assert thinking_budget_tokens() is None
    assert thinking_budget_tokens(reasoning_effort="low") == 1024
    assert thinking_budget_tokens(reasoning_effort="none") == 0
    assert thinking_budget_tokens(anthropic_budget_tokens=2048, reasoning_effort="high") == 2048
    assert thinking_budget_tokens(thinking_token_budget=10, anthropic_budget_tokens=2048) == 10
    with pytest.raises(ParameterError, match="reasoning_effort: unknown effort 'max'"):
        thinking_budget_tokens(reasoning_effort="max")
    with pytest.raises(ParameterError, match="thinking_token_budget"):
        thinking_budget_tokens(thinking_token_budget=-1)


class _Tokenizer:
    def __init__(self, vocab: dict[str, list[int]]) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.vocab[text]


def test_markers_need_single_token_tags() -> None:
    qwen3 = _Tokenizer({"<think>": [151667], "</think>": [151668], "\n</think>\n\n": [198, 151668, 271]})
    markers = reasoning_markers(qwen3)
    assert markers == ReasoningMarkers(151667, 151668, (198, 151668, 271))
    assert markers.after_end_token_ids == (271,)
    spelled = _Tokenizer({"<think>": [27, 26865, 29], "</think>": [522, 26865, 29], "\n</think>\n\n": [1]})
    assert reasoning_markers(spelled) is None
    with pytest.raises(ValueError, match="end_token_id"):
        ReasoningMarkers(1, 2, (3,))
