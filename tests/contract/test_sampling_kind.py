"""The sampling kind picks exactly the reference's ids: greedy and seeded rows with every filter,
penalties, bias and allowed-token masks, and logprobs.

The reference is `sample_rows` (atlas/adapters/mock/sampler.py), the numpy statement of the
`SamplingTensors` contract that tests/unit/test_sampling*.py check rule by rule and
statistically; on the mock this suite checks the member's plumbing around it.
"""

from __future__ import annotations


import msgspec
import numpy as np
import pytest
from kind_references import bf16

from atlas.adapters.mock.sampler import sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.sampling import PackedSampling, pack_rows
from atlas.domain.token_mask import ALL_ALLOWED, allow_only, bitmask_width
from atlas.ports.gpu import DType
from atlas.ports.kernels.sampling import LogprobsOut, SamplingTensors


def _random_rows(rng: np.random.Generator, vocab_size: int, num_rows: int) -> list[SamplingRow]:
    rows = []
    for r in range(num_rows):
        kind = r % 8
        penalty_ids = tuple(int(t) for t in rng.choice(vocab_size, size=int(rng.integers(1, 60)), replace=False))
        counts = tuple(int(c) for c in rng.integers(0, 4, len(penalty_ids)))
        bias_ids = tuple(int(t) for t in rng.choice(vocab_size, size=5, replace=False))
        bias_values = (float("-inf"), 5.0, -3.5, 2.25, 0.5)
        rows.append(
            SamplingRow(
                temperature=0.0 if kind == 0 else float(rng.choice([0.3, 0.7, 1.0, 1.6])),
                top_k=[0, 0, 40, 0, 1, 200, 0, 7][kind],
                top_p=[1.0, 1.0, 1.0, 0.9, 1.0, 0.5, 0.95, 0.3][kind],
                min_p=[0.0, 0.0, 0.0, 0.0, 0.0, 0.05, 0.1, 0.0][kind],
                seed=int(rng.integers(0, 2**63)) * 2 + 1,
                counter=int(rng.integers(0, 5000)),
                repetition_penalty=[1.0, 1.3, 1.0, 1.1, 1.0, 0.8, 1.2, 1.0][kind],
                presence_penalty=[0.0, 0.5, 0.0, 0.0, 0.2, 0.0, 1.0, 0.0][kind],
                frequency_penalty=[0.0, 0.25, 0.0, 0.3, 0.0, 0.0, 0.5, 0.0][kind],
                penalty_token_ids=penalty_ids,
                penalty_output_counts=counts,
                bias_token_ids=bias_ids if kind in (2, 3, 6) else (),
                bias_values=bias_values if kind in (2, 3, 6) else (),
            )
        )
    return rows


def _tensors(backend, packed: PackedSampling) -> SamplingTensors:
    def csr(array, dtype):  # a one-element placeholder for an empty array, as a runner's buffer
        return backend.upload(array.astype(dtype) if array.size else np.zeros(1, dtype))

    return SamplingTensors(
        temperature=backend.upload(packed.temperature),
        top_k=backend.upload(packed.top_k),
        top_p=backend.upload(packed.top_p),
        min_p=backend.upload(packed.min_p),
        seeds=backend.upload(packed.seeds),
        counters=backend.upload(packed.counters),
        repetition_penalty=backend.upload(packed.repetition_penalty),
        presence_penalty=backend.upload(packed.presence_penalty),
        frequency_penalty=backend.upload(packed.frequency_penalty),
        penalty_offsets=backend.upload(packed.penalty_offsets),
        penalty_token_ids=csr(packed.penalty_token_ids, np.int32),
        penalty_output_counts=csr(packed.penalty_output_counts, np.int32),
        bias_offsets=backend.upload(packed.bias_offsets),
        bias_token_ids=csr(packed.bias_token_ids, np.int32),
        bias_values=csr(packed.bias_values, np.float32),
        num_rows=packed.num_rows,
        all_greedy=packed.all_greedy,
        any_penalties=packed.any_penalties,
        any_bias=packed.any_bias,
        token_mask=backend.upload(packed.token_mask) if packed.token_mask is not None else None,
    )


def _sample(harness, logits: np.ndarray, rows, logits_dtype: DType = DType.F32, num_top: int | None = None,
            token_mask: np.ndarray | None = None):
    """(ids, logprobs or None) from the backend, and the reference's for the same rows."""
    backend = harness.backend
    packed = msgspec.structs.replace(pack_rows(rows), token_mask=token_mask)
    num_rows = logits.shape[0]
    ids = harness.poisoned((num_rows,), DType.I32)
    logprobs = None
    if num_top is not None:
        logprobs = LogprobsOut(harness.poisoned((num_rows,), DType.F32), harness.poisoned((num_rows, num_top), DType.I32),
                               harness.poisoned((num_rows, num_top), DType.F32), num_top)
    backend.sampling.sample(backend.upload(logits, logits_dtype), _tensors(backend, packed), ids, logprobs)
    got_logprobs = None if logprobs is None else tuple(
        harness.fetch(t) for t in (logprobs.sampled, logprobs.top_ids, logprobs.top_logprobs)
    )
    return harness.fetch(ids), got_logprobs, sample_rows(logits, packed, num_top)


@pytest.mark.parametrize("vocab_size, logits_dtype", [(32000, DType.BF16), (49152, DType.F32), (1001, DType.F32)])
def test_sampled_ids_equal_the_reference(harness, rng, vocab_size, logits_dtype):
    num_rows = 24
    logits = bf16(rng.standard_normal((num_rows, vocab_size)) * 2.5)  # bf16 values tie often: tie rules run
    ids, _, expected = _sample(harness, logits, _random_rows(rng, vocab_size, num_rows), logits_dtype)
    np.testing.assert_array_equal(ids, expected.token_ids)
    assert len(set(ids.tolist())) > num_rows // 2  # seeded rows really draw


def test_ties_pick_the_lowest_id(harness, rng):
    logits = bf16(rng.standard_normal((9, 5000)))
    logits[:, [17, 900, 4999]] = 9.0
    rows = [SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=r, counter=0) for r in range(9)]
    ids, _, _ = _sample(harness, logits, rows)
    assert (ids == 17).all()


def test_a_seeded_row_draws_the_same_token_in_any_batch(harness, rng):
    logits = bf16(rng.standard_normal((1, 32000)))
    row = SamplingRow(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=12345, counter=7)
    alone = _sample(harness, logits, [row])[0]
    batch = np.concatenate([bf16(rng.standard_normal((5, 32000))), logits])
    in_batch = _sample(harness, batch, [*_random_rows(rng, 32000, 5), row])[0]
    assert in_batch[-1] == alone[0]


@pytest.mark.parametrize("num_top", [0, 5, 20])
def test_logprobs(harness, rng, num_top):
    logits = bf16(rng.standard_normal((6, 32000)) * 3)
    ids, logprobs, expected = _sample(harness, logits, _random_rows(rng, 32000, 6), num_top=num_top)
    np.testing.assert_array_equal(ids, expected.token_ids)
    np.testing.assert_allclose(logprobs[0], expected.sampled_logprobs, rtol=1e-5, atol=1e-5)
    if num_top:
        np.testing.assert_array_equal(logprobs[1], expected.top_ids)
        np.testing.assert_allclose(logprobs[2], expected.top_logprobs, rtol=1e-5, atol=1e-5)


def _random_masks(rng: np.random.Generator, vocab_size: int, num_rows: int) -> np.ndarray:
    """Rows of the shapes grammars make: all allowed, one token (a forced one; the last id
    too), a few scattered ids, a dense random half."""
    masks = np.zeros((num_rows, bitmask_width(vocab_size)), dtype=np.int32)
    for row in range(num_rows):
        kind = row % 5
        if kind == 0:
            masks[row] = ALL_ALLOWED
        elif kind == 1:
            allow_only(masks[row], [int(rng.integers(0, vocab_size)) if row % 2 else vocab_size - 1])
        elif kind == 2:
            allow_only(masks[row], rng.choice(vocab_size, size=7, replace=False).tolist())
        else:
            allow_only(masks[row], np.flatnonzero(rng.random(vocab_size) < 0.5).tolist())
    return masks


@pytest.mark.parametrize("vocab_size, logits_dtype", [(32000, DType.BF16), (49152, DType.F32), (1001, DType.F32)])
def test_masked_rows_sample_the_reference_ids_inside_the_mask(harness, rng, vocab_size, logits_dtype):
    """The mask after bias, before temperature, on greedy rows (the one-pass argmax) and on every
    filter; a row whose argmax is masked must move to an allowed id."""
    num_rows = 20
    logits = bf16(rng.standard_normal((num_rows, vocab_size)) * 2.5)
    masks = _random_masks(rng, vocab_size, num_rows)
    rows = _random_rows(rng, vocab_size, num_rows)
    greedy = [msgspec.structs.replace(row, temperature=0.0, penalty_token_ids=(), penalty_output_counts=(),
                                      bias_token_ids=(), bias_values=()) for row in rows[:6]]
    ids, _, expected = _sample(harness, logits, greedy + rows[6:], logits_dtype, token_mask=masks)
    np.testing.assert_array_equal(ids, expected.token_ids)
    allowed = (masks[np.arange(num_rows), ids >> 5].view(np.uint32) >> (ids & 31).astype(np.uint32)) & 1
    assert allowed.all()
    unmasked = _sample(harness, logits, greedy + rows[6:], logits_dtype)[0]
    assert (ids != unmasked).any()  # the masks changed some draws


def test_logprobs_ignore_the_mask(harness, rng):
    logits = bf16(rng.standard_normal((5, 32000)) * 3)
    rows = _random_rows(rng, 32000, 5)
    masks = _random_masks(rng, 32000, 5)
    ids, logprobs, expected = _sample(harness, logits, rows, num_top=3, token_mask=masks)
    _, unmasked_logprobs, _ = _sample(harness, logits, rows, num_top=3)
    np.testing.assert_array_equal(ids, expected.token_ids)
    np.testing.assert_array_equal(logprobs[1], unmasked_logprobs[1])  # top ids of the raw logits
    np.testing.assert_allclose(logprobs[0], expected.sampled_logprobs, rtol=1e-5, atol=1e-5)
