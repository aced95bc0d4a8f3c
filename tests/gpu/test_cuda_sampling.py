"""The CUDA sampler picks exactly the mock's ids: greedy and seeded rows with every filter."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_harness import bf16, poisoned, sampling_tensors

from atlas.domain.batch import SamplingRow
from atlas.domain.sampling import pack_rows
from atlas.ports.gpu import DType, LogprobsOut

pytestmark = pytest.mark.gpu


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


def _sample_both(cuda_backend, mock_backend, logits: np.ndarray, rows, logits_dtype: DType, num_top: int | None):
    packed = pack_rows(rows)
    num_rows, vocab_size = logits.shape
    results = []
    for backend, dtype in ((cuda_backend, logits_dtype), (mock_backend, DType.F32)):
        ids = poisoned(backend, (num_rows,), DType.I32)
        logprobs = None
        if num_top is not None:
            logprobs = LogprobsOut(
                sampled=poisoned(backend, (num_rows,), DType.F32),
                top_ids=poisoned(backend, (num_rows, num_top), DType.I32),
                top_logprobs=poisoned(backend, (num_rows, num_top), DType.F32),
                num_top=num_top,
            )
        backend.sample(backend.upload(logits, dtype), sampling_tensors(backend, packed), ids, logprobs)
        results.append(
            (
                backend.download(ids),
                logprobs
                and tuple(backend.download(t) for t in (logprobs.sampled, logprobs.top_ids, logprobs.top_logprobs)),
            )
        )
    return results


@pytest.mark.parametrize(
    "vocab_size, logits_dtype", [(32000, DType.BF16), (49152, DType.F32), (151936, DType.BF16), (1001, DType.F32)]
)
def test_sampled_ids_equal_the_mock(cuda_backend, mock_backend, rng, vocab_size, logits_dtype):
    num_rows = 24
    # bf16 logits tie often: the tie rules are exercised, not just the common case.
    logits = bf16(rng.standard_normal((num_rows, vocab_size)) * 2.5)
    rows = _random_rows(rng, vocab_size, num_rows)
    (cuda_ids, _), (mock_ids, _) = _sample_both(cuda_backend, mock_backend, logits, rows, logits_dtype, None)
    np.testing.assert_array_equal(cuda_ids, mock_ids)
    assert len(set(cuda_ids.tolist())) > num_rows // 2  # seeded rows really draw


def test_all_greedy_batch_and_ties_pick_lowest_id(cuda_backend, mock_backend, rng):
    vocab_size, num_rows = 5000, 9
    logits = bf16(rng.standard_normal((num_rows, vocab_size)))
    logits[:, [17, 900, 4999]] = 9.0  # a three-way tie at the top of every row
    rows = [SamplingRow(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=r, counter=0) for r in range(num_rows)]
    (cuda_ids, _), (mock_ids, _) = _sample_both(cuda_backend, mock_backend, logits, rows, DType.BF16, None)
    np.testing.assert_array_equal(cuda_ids, mock_ids)
    assert (cuda_ids == 17).all()


def test_same_seed_and_counter_draw_the_same_token_in_any_batch(cuda_backend, mock_backend, rng):
    vocab_size = 32000
    logits = bf16(rng.standard_normal((1, vocab_size)))
    row = SamplingRow(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=12345, counter=7)
    alone = _sample_both(cuda_backend, mock_backend, logits, [row], DType.BF16, None)[0][0]
    others = _random_rows(rng, vocab_size, 5)
    batch_logits = np.concatenate([bf16(rng.standard_normal((5, vocab_size))), logits])
    in_batch = _sample_both(cuda_backend, mock_backend, batch_logits, [*others, row], DType.BF16, None)[0][0]
    assert in_batch[-1] == alone[0]


@pytest.mark.parametrize("num_top", [0, 5, 20])
def test_logprobs_match_the_mock(cuda_backend, mock_backend, rng, num_top):
    vocab_size, num_rows = 32000, 6
    logits = bf16(rng.standard_normal((num_rows, vocab_size)) * 3)
    rows = _random_rows(rng, vocab_size, num_rows)
    (cuda_ids, cuda_lp), (mock_ids, mock_lp) = _sample_both(
        cuda_backend, mock_backend, logits, rows, DType.BF16, num_top
    )
    np.testing.assert_array_equal(cuda_ids, mock_ids)
    np.testing.assert_allclose(cuda_lp[0], mock_lp[0], rtol=1e-5, atol=1e-5)
    if num_top:
        np.testing.assert_array_equal(cuda_lp[1], mock_lp[1])
        np.testing.assert_allclose(cuda_lp[2], mock_lp[2], rtol=1e-5, atol=1e-5)
