"""The mock's sampling kind: the numpy reference of `SamplingTensors`' rules.

Rows are processed as `SamplingTensors` documents: penalties, logit bias, the allowed-token
mask (`apply_token_bitmask`), temperature, top-k, top-p, min-p, then a Gumbel-max race on the
counter-based stream of `atlas.domain.sampling`.
The CUDA kernel must pick the same ids, so every float step below is the one the contract
names, in float32:

    processed = logit / rep if logit > 0 else logit * rep        (tokens seen in the context)
    processed = processed - (presence + frequency * count)       (tokens with count > 0)
    processed = processed + bias
    processed = -inf where the row's mask clears the token's bit
    score     = processed / T - log(-log(u))

Top-p ranks tokens by processed logit (ties: lowest id) and accumulates the probabilities
exp((processed - max) / T) / sum in float64; a token whose preceding mass lies within
rounding of top_p may fall either side on another backend.

Cost: greedy rows are one argmax over [R, V]. A row without filters races over the whole
vocabulary; a filtered row races only over the tokens it keeps, found with a partition
(O(V)), never a full sort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from atlas.adapters.mock.tensor import MockTensor
from atlas.domain.sampling import PackedSampling, neg_gumbel, stream_keys
from atlas.domain.token_mask import apply_token_bitmask
from atlas.ports.kernels.sampling import LogprobsOut, SamplingTensors

if TYPE_CHECKING:
    from atlas.adapters.mock.backend import MockGpuBackend

# First guess of how many tokens a top-p nucleus holds; grown 8x until the mass suffices.
_NUCLEUS_FIRST_GUESS = 256
# Width of the range the race noise can take (19.46 in float32), with a margin for rounding.
_NOISE_SPREAD = 20.0


@dataclass(frozen=True, slots=True)
class SampleOutput:
    token_ids: np.ndarray  # [R] i32
    sampled_logprobs: np.ndarray | None  # [R] f32, log p of the chosen token under the raw logits
    top_ids: np.ndarray | None  # [R, K] i32, most likely first (ties: lowest id)
    top_logprobs: np.ndarray | None  # [R, K] f32


def sample_rows(logits: np.ndarray, packed: PackedSampling, num_top_logprobs: int | None) -> SampleOutput:
    """One token per row of `logits` [R, V] under `packed`'s rules (see the module docstring).

    `num_top_logprobs` None skips logprobs; 0 returns only the sampled token's. Logprobs are
    log_softmax of the raw logits, before penalties, bias or temperature. `logits` is not
    modified. Raises `ValueError` naming the argument when shapes disagree, a penalty/bias
    token id is outside [0, V), or a mask row allows no token.
    """
    logits = np.asarray(logits, dtype=np.float32)
    num_rows = packed.num_rows
    if logits.ndim != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"logits: expected [{num_rows}, V], got {list(logits.shape)}")
    processed = apply_penalties_and_bias(logits, packed)
    if packed.token_mask is not None:
        processed = apply_token_bitmask(processed, packed.token_mask[:num_rows])
    if packed.all_greedy:
        token_ids = np.argmax(processed, axis=1).astype(np.int32)
    else:
        token_ids = _draw(processed, packed, packed.temperature[:num_rows])
    if num_top_logprobs is None:
        return SampleOutput(token_ids, None, None, None)
    top_ids = _top_ids(logits, num_top_logprobs)
    logprobs = _logprobs_at(logits, np.concatenate([token_ids[:, None].astype(np.int64), top_ids], axis=1))
    return SampleOutput(token_ids, logprobs[:, 0], top_ids.astype(np.int32), logprobs[:, 1:])


# -- penalties and bias ----------------------------------------------------------------------


def apply_penalties_and_bias(logits: np.ndarray, packed: PackedSampling) -> np.ndarray:
    """Rules 1 and 2 on float32 logits [R, V]: a new array when either applies, else `logits`.

    Raises `ValueError` when a penalty or bias token id lies outside [0, V).
    """
    if not (packed.any_penalties or packed.any_bias):
        return logits
    processed = logits.copy()
    flat = processed.reshape(-1)
    vocab_size = logits.shape[1]
    if packed.any_penalties:
        rows, entries = _csr_rows(packed.penalty_offsets, packed.num_rows)
        flat_idx = rows * vocab_size + _checked_ids(packed.penalty_token_ids[entries], vocab_size, "penalty")
        counts = packed.penalty_output_counts[entries]
        values = flat[flat_idx]
        repetition = packed.repetition_penalty[rows]
        values = np.where(values > 0, values / repetition, values * repetition)
        frequency_term = packed.presence_penalty[rows] + packed.frequency_penalty[rows] * counts.astype(np.float32)
        values = np.where(counts > 0, values - frequency_term, values)
        flat[flat_idx] = values
    if packed.any_bias:
        rows, entries = _csr_rows(packed.bias_offsets, packed.num_rows)
        flat_idx = rows * vocab_size + _checked_ids(packed.bias_token_ids[entries], vocab_size, "bias")
        # add.at so a repeated id adds every bias given for it, in order.
        np.add.at(flat, flat_idx, packed.bias_values[entries])
    return processed


def _csr_rows(offsets: np.ndarray, num_rows: int) -> tuple[np.ndarray, slice]:
    """The row index of every entry of the first `num_rows` CSR rows, and where they lie."""
    offsets = offsets[: num_rows + 1].astype(np.int64)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(offsets))
    return rows, slice(int(offsets[0]), int(offsets[-1]))


def _checked_ids(token_ids: np.ndarray, vocab_size: int, name: str) -> np.ndarray:
    ids = token_ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name}_token_ids: ids must lie in [0, {vocab_size})")
    return ids


# -- drawing ---------------------------------------------------------------------------------


def _draw(processed: np.ndarray, packed: PackedSampling, temperature: np.ndarray) -> np.ndarray:
    num_rows = processed.shape[0]
    token_ids = np.argmax(processed, axis=1).astype(np.int32)  # right for greedy rows
    keys = stream_keys(packed.seeds[:num_rows], packed.counters[:num_rows])
    # One row at a time: a row's uint64 scratch stays in cache, three times faster than
    # hashing [R, V] at once.
    for row in np.flatnonzero(temperature != 0):
        kept = _kept_token_ids(
            processed[row], int(packed.top_k[row]), float(packed.top_p[row]), packed.min_p[row], temperature[row]
        )
        if kept is None:
            token_ids[row] = _race(processed[row] / temperature[row], keys[row : row + 1])
        elif kept.size:  # empty when every token is banned (-inf): the argmax stands
            token_ids[row] = kept[_race(processed[row, kept] / temperature[row], keys[row : row + 1], kept)]
    return token_ids


def _race(scaled: np.ndarray, key: np.ndarray, token_ids: np.ndarray | None = None) -> int:
    """Index into `scaled` [n] (logit / T of `token_ids`, ascending; None: 0..n-1) of the winner.

    The noise -log(-log(u)) lies within [-2.82, 16.64] for u in [2**-24, 1 - 2**-24], so a
    token whose scaled logit trails the best by more than that spread can never win: it is not
    hashed at all. On real logits that skips most of the vocabulary; the winner is unchanged.
    """
    threshold = np.float64(scaled.max()) - _NOISE_SPREAD  # float64: no rounding at large logits
    contenders = np.flatnonzero(scaled >= threshold)
    if contenders.size == 0:  # NaN logits: no comparison holds
        return 0
    ids = contenders if token_ids is None else token_ids[contenders]
    scores = scaled[contenders] - neg_gumbel(key, ids.astype(np.uint64))
    return int(contenders[np.argmax(scores)])


def _kept_token_ids(
    logits: np.ndarray, top_k: int, top_p: float, min_p: np.float32, temperature: np.float32
) -> np.ndarray | None:
    """Ascending ids that survive top-k, then top-p over that set, then min-p (logits [V]).

    None when no filter applies (every token is kept); empty when every logit is -inf.
    """
    vocab_size = logits.shape[0]
    kept = _top_k_ids(logits, top_k) if 0 < top_k < vocab_size else None
    if top_p >= 1 and min_p <= 0:
        return kept
    logit_max = logits.max()
    if not np.isfinite(logit_max):
        return np.empty(0, dtype=np.int64)
    if top_p < 1:
        kept = _nucleus_ids(logits, kept, top_p, logit_max, temperature)
    if min_p > 0:
        candidates = logits if kept is None else logits[kept]
        passes = np.exp((candidates - logit_max) / temperature) >= min_p
        kept = np.flatnonzero(passes) if kept is None else kept[passes]
    return kept


def _top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest logits; among equal logits at the cut, the lowest ids."""
    threshold = np.partition(logits, logits.shape[0] - k)[logits.shape[0] - k]
    above = np.flatnonzero(logits > threshold)
    at_threshold = np.flatnonzero(logits == threshold)[: k - above.size]
    return np.sort(np.concatenate([above, at_threshold]))


def _nucleus_ids(
    logits: np.ndarray, candidate_ids: np.ndarray | None, top_p: float, logit_max: np.float32, temperature: np.float32
) -> np.ndarray:
    """Ascending ids of the top-p nucleus among `candidate_ids` (None: the whole vocabulary).

    Only the head of the distribution is sorted: the `size` largest logits (all ties at the
    cut included) suffice once their mass reaches top_p, since every token outside them ranks
    after them and so has a preceding mass >= top_p.
    """
    ids = np.arange(logits.shape[0]) if candidate_ids is None else candidate_ids
    values = logits[ids]
    weights = np.exp((values - logit_max) / temperature)
    total = weights.sum(dtype=np.float64)
    size = min(_NUCLEUS_FIRST_GUESS, ids.size)
    while True:
        threshold = np.partition(values, values.size - size)[values.size - size]
        head = np.flatnonzero(values >= threshold)
        if head.size == ids.size or weights[head].sum(dtype=np.float64) / total >= top_p:
            break
        size = min(size * 8, ids.size)
    order = head[np.argsort(-values[head], kind="stable")]  # head is ascending: ties keep id order
    preceding = np.zeros(order.size, dtype=np.float64)
    np.cumsum(weights[order[:-1]], dtype=np.float64, out=preceding[1:])
    num_kept = int(np.count_nonzero(preceding / total < top_p))
    return np.sort(ids[order[:num_kept]])


# -- logprobs --------------------------------------------------------------------------------


def _logprobs_at(logits: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """log_softmax(logits) [R, V] at token_ids [R, n], without building the [R, V] result."""
    logit_max = logits.max(axis=1, keepdims=True)
    exps = np.subtract(logits, logit_max)
    np.exp(exps, out=exps)
    log_totals = np.log(exps.sum(axis=1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return (np.take_along_axis(logits, token_ids, axis=1) - logit_max) - log_totals


def _top_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """[R, k] ids of each row's k largest logits, largest first (ties: lowest id first).

    Every logit >= the row's k-th largest value is a candidate (ties at the cut included);
    sorting candidates by (row, -logit, id) and taking each row's first k applies the tie rule.
    """
    num_rows, vocab_size = logits.shape
    k = min(k, vocab_size)
    if k == 0:
        return np.empty((num_rows, 0), dtype=np.int64)
    # Row by row: numpy partitions a [V] row faster than a row of an [R, V] matrix.
    kth_largest = np.array([np.partition(row, vocab_size - k)[vocab_size - k] for row in logits])
    rows, ids = np.divmod(np.flatnonzero(logits >= kth_largest[:, None]), vocab_size)
    order = np.lexsort((ids, -logits[rows, ids], rows))
    row_starts = np.searchsorted(rows, np.arange(num_rows))  # flatnonzero yields rows in order
    return ids[order][row_starts[:, None] + np.arange(k)]


class MockSampling:
    """`SamplingKernels` over `sample_rows`."""

    def __init__(self, backend: MockGpuBackend) -> None:
        self._backend = backend

    def sample(
        self,
        logits: MockTensor,
        params: SamplingTensors,
        out_token_ids: MockTensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        self._backend.enter("sampling.sample")
        packed = PackedSampling(
            temperature=params.temperature.data,
            top_k=params.top_k.data,
            top_p=params.top_p.data,
            min_p=params.min_p.data,
            seeds=params.seeds.data,
            counters=params.counters.data,
            repetition_penalty=params.repetition_penalty.data,
            presence_penalty=params.presence_penalty.data,
            frequency_penalty=params.frequency_penalty.data,
            penalty_offsets=params.penalty_offsets.data,
            penalty_token_ids=params.penalty_token_ids.data,
            penalty_output_counts=params.penalty_output_counts.data,
            bias_offsets=params.bias_offsets.data,
            bias_token_ids=params.bias_token_ids.data,
            bias_values=params.bias_values.data,
            num_rows=params.num_rows,
            all_greedy=params.all_greedy,
            any_penalties=params.any_penalties,
            any_bias=params.any_bias,
            token_mask=params.token_mask.data if params.token_mask is not None else None,
        )
        num_top = logprobs.num_top if logprobs is not None else None
        result = sample_rows(logits.as_f32()[: params.num_rows], packed, num_top)
        out_token_ids.data[: params.num_rows] = result.token_ids
        if logprobs is not None:
            logprobs.sampled.data[: params.num_rows] = result.sampled_logprobs
            if logprobs.num_top:
                logprobs.top_ids.data[: params.num_rows] = result.top_ids
                logprobs.top_logprobs.data[: params.num_rows] = result.top_logprobs
