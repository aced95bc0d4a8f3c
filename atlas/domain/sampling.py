"""Sampling rules on the host side: what each sequence asks of the device's sampler.

The device applies the rules in the order `atlas.ports.gpu.SamplingTensors` documents; this
module turns a sequence's state into a `SamplingRow` (penalty context, biases, the position
in its random stream), rows into the flat arrays the device reads (`pack_rows`), and holds the
counter-based random stream every backend must reproduce bit for bit (`counter_uniforms`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
import msgspec
import numpy as np

from atlas.domain.batch import SamplingRow
from atlas.domain.requests import ParameterError, SamplingParams
from atlas.domain.sequence import Sequence

NEG_INF = float("-inf")

_INT32_MAX = 2**31 - 1

# The random stream (see `SamplingTensors`): one splitmix64 hash per (seed, counter, token id).
_COUNTER_MIX = np.uint64(0x9E3779B97F4A7C15)
_TOKEN_MIX = np.uint64(0xD1B54A32D192ED03)
_SPLITMIX_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_SPLITMIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)
_SPLITMIX_MUL_2 = np.uint64(0x94D049BB133111EB)
_UINT64_MASK = 0xFFFF_FFFF_FFFF_FFFF
# 23 random bits: (m + 0.5) * 2**-23 is then exact in float32 (24-bit significand) and lies in
# [2**-24, 1 - 2**-24]. With 24 bits the top value would round to 1.0 and win every race.
_UNIFORM_SHIFT = np.uint64(41)
_UNIFORM_SCALE = np.float32(2.0**-23)


def sampling_row(seq: Sequence) -> SamplingRow:
    """The row for the next token of `seq` (called once its whole context is computed): the
    first of `sampling_rows`.

    Most steps of most sequences (no drafts, no penalties, past min_tokens) differ only in the
    counter: their row is the sequence's `sampling_row_base`, built on first use, with it."""
    num_drafts = seq.num_draft_tokens
    counter = seq.num_output_tokens - num_drafts
    if not num_drafts and counter >= seq.sampling.min_tokens:
        base = seq.sampling_row_base  # only ever built for a request without penalties
        if base is None and not seq.has_penalties:
            base = seq.sampling_row_base = _build_rows(seq, counter)[0]
        if base is not None:
            return msgspec.structs.replace(base, counter=counter)
    return _build_rows(seq, counter)[0]


def sampling_rows(seq: Sequence) -> tuple[SamplingRow, ...]:
    """The rows of `seq`'s next step: one, or 1 + k when the step verifies k drafts. Row j
    draws output token c + j (c: tokens sampled before the drafts) as if drafts[:j] were
    already output: its counter is c + j, its penalty counts include them, and eos and stop
    ids stay banned while c + j < min_tokens."""
    num_drafts = seq.num_draft_tokens
    if not num_drafts:
        return (sampling_row(seq),)
    counter = seq.num_output_tokens - num_drafts
    if counter >= seq.sampling.min_tokens and not seq.has_penalties:
        # no penalty counts and no bans: every row is the request's base row at its counter
        base = seq.sampling_row_base
        if base is None:
            base = seq.sampling_row_base = _build_rows(seq, counter)[0]
        replace = msgspec.structs.replace
        return tuple([replace(base, counter=counter + offset) for offset in range(1 + num_drafts)])
    return _build_rows(seq, counter)


def _build_rows(seq: Sequence, counter: int) -> tuple[SamplingRow, ...]:
    """`sampling_rows` from the request's parameters, `counter` being c."""
    params = seq.sampling
    drafts = seq.draft_token_ids
    free = dict(params.logit_bias or {})
    banned = {**free, **dict.fromkeys(seq.eos_token_ids | seq.stop_token_ids, NEG_INF)}
    counts = dict(seq.penalty_counts()) if params.has_penalties else None
    seed = seq.request.seed & _UINT64_MASK
    rows = []
    for position in range(1 + len(drafts)):
        if position and counts is not None:
            counts[drafts[position - 1]] = counts.get(drafts[position - 1], 0) + 1
        bias = banned if counter + position < params.min_tokens else free
        rows.append(SamplingRow(
            temperature=params.temperature,
            top_k=max(params.top_k, 0),
            top_p=params.top_p,
            min_p=params.min_p,
            seed=seed,
            counter=counter + position,
            repetition_penalty=params.repetition_penalty,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            penalty_token_ids=tuple(counts) if counts is not None else (),
            penalty_output_counts=tuple(counts.values()) if counts is not None else (),
            bias_token_ids=tuple(bias),
            bias_values=tuple(bias.values()),
            num_logprobs=params.logprobs,
        ))
    return tuple(rows)


def validate_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Reject token ids the model cannot produce before they reach the device.

    `vocab_size` is the number of logits per row (the model's output width). Raises
    `ParameterError` naming `logit_bias` or `stop_token_ids` for an id >= vocab_size (negative
    ids are already rejected when `SamplingParams` is built).
    """
    for token_id in params.logit_bias or {}:
        if not 0 <= token_id < vocab_size:
            raise ParameterError(
                "logit_bias", f"token id {token_id} is outside the vocabulary (ids are 0..{vocab_size - 1})"
            )
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise ParameterError(
                "stop_token_ids", f"token id {token_id} is outside the vocabulary (ids are 0..{vocab_size - 1})"
            )


class PackedSampling(msgspec.Struct, frozen=True):
    """Host arrays with exactly the fields of `SamplingTensors` (same names, dtypes, meaning).

    The model runner copies them into persistent device buffers. Arrays may be longer than
    `num_rows` (a persistent buffer sized for the largest step): readers use the first
    `num_rows` entries and the CSR ranges `offsets[r]:offsets[r + 1]` only.

        rows         r0 (3 penalised ids)   r1 (none)   r2 (2 ids)
        offsets      [0,                    3,          3,          5]
        token_ids    [a  b  c               |           d  e]
    """

    temperature: np.ndarray  # [R] f32, 0 = greedy
    top_k: np.ndarray  # [R] i32, 0 = off
    top_p: np.ndarray  # [R] f32, 1 = off
    min_p: np.ndarray  # [R] f32, 0 = off
    seeds: np.ndarray  # [R] i64 holding the uint64 bit pattern
    counters: np.ndarray  # [R] i64
    repetition_penalty: np.ndarray  # [R] f32, 1 = off
    presence_penalty: np.ndarray  # [R] f32
    frequency_penalty: np.ndarray  # [R] f32
    penalty_offsets: np.ndarray  # [R + 1] i32
    penalty_token_ids: np.ndarray  # [P] i32
    penalty_output_counts: np.ndarray  # [P] i32
    bias_offsets: np.ndarray  # [R + 1] i32
    bias_token_ids: np.ndarray  # [B] i32
    bias_values: np.ndarray  # [B] f32
    num_rows: int
    all_greedy: bool
    any_penalties: bool
    any_bias: bool
    token_mask: np.ndarray | None = None  # [R, ceil(V / 32)] i32 allowed-token bits; None: all allowed


def pack_rows(rows: SequenceOf[SamplingRow]) -> PackedSampling:
    """Flatten `rows` into `PackedSampling` (row order kept).

    Penalty entries are packed only for rows whose penalties are not neutral, so a step where
    nobody asks for penalties ships none. Raises `ValueError` when a row's penalty ids and
    counts (or bias ids and values) differ in length, or a seed is outside [0, 2**64).
    """
    num_rows = len(rows)
    # One pass of Python over the rows, then numpy: at batch 64 this runs every step, and a
    # pass per field cost more than the step's numpy work.
    scalars = [
        (row.temperature, row.top_p, row.min_p, row.repetition_penalty, row.presence_penalty,
         row.frequency_penalty, row.top_k, row.seed, row.counter)
        for row in rows
    ]
    *float_columns, top_ks, seeds, counters = tuple(zip(*scalars)) or ((),) * 9
    floats = np.array(float_columns, np.float32).reshape(len(float_columns), num_rows)
    if seeds and (min(seeds) < 0 or max(seeds) > _UINT64_MASK):
        bad = next(seed for seed in seeds if not 0 <= seed <= _UINT64_MASK)
        raise ValueError(f"seed: {bad} is not an unsigned 64-bit integer")
    penalised: list[SamplingRow] = []  # rows whose penalties are not neutral
    penalty_lengths: list[int] = []  # per row; empty while no row is penalised
    if any(row.penalty_token_ids or row.penalty_output_counts for row in rows):
        if any(len(row.penalty_token_ids) != len(row.penalty_output_counts) for row in rows):
            raise ValueError("penalty_output_counts: needs one count per penalty token id")
        penalised = [row for row in rows if row.has_penalties]
        penalty_lengths = [len(row.penalty_token_ids) if row.has_penalties else 0 for row in rows] if penalised else []
    bias_rows = [row for row in rows if row.bias_token_ids or row.bias_values]
    if any(len(row.bias_token_ids) != len(row.bias_values) for row in bias_rows):
        raise ValueError("bias_values: needs one value per bias token id")
    temperature = floats[0]
    return PackedSampling(
        temperature=temperature,
        top_k=np.array([min(top_k, _INT32_MAX) for top_k in top_ks], np.int32),
        top_p=floats[1],
        min_p=floats[2],
        seeds=np.array(seeds, dtype=np.uint64).view(np.int64),
        counters=np.array(counters, dtype=np.int64),
        repetition_penalty=floats[3],
        presence_penalty=floats[4],
        frequency_penalty=floats[5],
        penalty_offsets=_offsets(penalty_lengths, num_rows),
        penalty_token_ids=_flatten([row.penalty_token_ids for row in penalised], np.int32),
        penalty_output_counts=_flatten([row.penalty_output_counts for row in penalised], np.int32),
        bias_offsets=_offsets([len(row.bias_token_ids) for row in rows] if bias_rows else [], num_rows),
        bias_token_ids=_flatten([row.bias_token_ids for row in bias_rows], np.int32),
        bias_values=_flatten([row.bias_values for row in bias_rows], np.float32),
        num_rows=num_rows,
        all_greedy=not temperature.any(),
        any_penalties=bool(penalised),
        any_bias=any(row.bias_token_ids for row in bias_rows),
    )


class RowPacker:
    """`pack_rows` for a worker's stream of steps. A step whose rows equal those of the last
    step with as many rows but for their counters (the same sequences in the same order,
    decoding on) shares that step's arrays and packs only its counters; any other step is
    packed afresh, so sequences leaving, joining or moving, or a row changing (a min_tokens ban
    lifted), cost a full pack. The last pack of each of a few row counts is kept: a speculative
    lone sequence alternates one-row steps with verify steps padded to a graph's size, and one
    remembered pack would miss on every step (a full pack is ~15-25 us against ~7)."""

    _ROW_COUNTS = 4  # row counts remembered, the least recently packed forgotten first

    def __init__(self) -> None:
        self._last: dict[int, tuple[list[SamplingRow], PackedSampling]] = {}

    def pack(self, rows: list[SamplingRow]) -> PackedSampling:
        """`pack_rows(rows)`, with the same errors. The arrays may be an earlier result's:
        read them, never write them."""
        num_rows = len(rows)
        last = self._last.pop(num_rows, None)
        if last is not None and _same_but_counters(rows, last[0]):
            counters = np.fromiter([row.counter for row in rows], np.int64, num_rows)
            packed = msgspec.structs.replace(last[1], counters=counters)
        else:
            packed = pack_rows(rows)
            if len(self._last) >= self._ROW_COUNTS:
                del self._last[next(iter(self._last))]
        self._last[num_rows] = (list(rows), packed)
        return packed


def _same_but_counters(rows: SequenceOf[SamplingRow], previous: SequenceOf[SamplingRow]) -> bool:
    """Whether `rows` equal `previous` (as many) but for their counters."""
    with_counter = msgspec.structs.replace
    for row, old in zip(rows, previous):
        if row is not old and row != with_counter(old, counter=row.counter):
            return False
    return True


def _offsets(lengths: list[int], num_rows: int) -> np.ndarray:
    """CSR offsets [num_rows + 1] of rows of `lengths` (empty: every row has none)."""
    offsets = np.zeros(num_rows + 1, dtype=np.int32)
    if lengths:
        np.cumsum(lengths, out=offsets[1:])
    return offsets


def _flatten(groups: list[tuple], dtype: type) -> np.ndarray:
    return np.fromiter(itertools.chain.from_iterable(groups), dtype=dtype)


# -- the random stream -----------------------------------------------------------------------


def stream_keys(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """uint64 [R]: `seed ^ (counter * 0x9E3779B97F4A7C15)` per row, in wrapping arithmetic.

    `seeds` may be int64 (the packed bit pattern) or uint64; `counters` any integer dtype.
    """
    seed_bits = np.asarray(seeds).astype(np.uint64, copy=False)
    return seed_bits ^ (np.asarray(counters).astype(np.uint64) * _COUNTER_MIX)


def token_uniforms(keys: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """float32 uniforms in (0, 1) for every (key, token id) pair under numpy broadcasting.

    `keys` come from `stream_keys` (shape it [R, 1] against token ids [V] for a matrix).
    Each value is `((splitmix64(key ^ token_id * 0xD1B54A32D192ED03) >> 41) + 0.5) * 2**-23`,
    exact in float32, so every backend computes the same bits.
    """
    x = np.bitwise_xor(keys, np.asarray(token_ids).astype(np.uint64) * _TOKEN_MIX)
    scratch = np.empty_like(x)
    x += _SPLITMIX_GAMMA
    _xor_shift(x, 30, scratch)
    x *= _SPLITMIX_MUL_1
    _xor_shift(x, 27, scratch)
    x *= _SPLITMIX_MUL_2
    _xor_shift(x, 31, scratch)
    np.right_shift(x, _UNIFORM_SHIFT, out=x)
    uniforms = x.astype(np.float32)
    uniforms += np.float32(0.5)
    uniforms *= _UNIFORM_SCALE
    return uniforms


def _xor_shift(x: np.ndarray, shift: int, scratch: np.ndarray) -> None:
    np.right_shift(x, np.uint64(shift), out=scratch)
    np.bitwise_xor(x, scratch, out=x)


def counter_uniforms(seed: int, counter: int, vocab_size: int) -> np.ndarray:
    """float32 [vocab_size]: the uniforms of draw number `counter` of `seed`, one per token id.

    `seed` is taken modulo 2**64 (a negative seed is its two's-complement bit pattern).
    Raises `ValueError` for a negative counter or vocab size.
    """
    if counter < 0 or vocab_size < 0:
        raise ValueError(f"counter and vocab_size must be >= 0 (got {counter}, {vocab_size})")
    keys = stream_keys(np.array([seed & _UINT64_MASK], dtype=np.uint64), np.array([counter]))
    return token_uniforms(keys, np.arange(vocab_size, dtype=np.uint64))


def neg_gumbel(keys: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """float32 `log(-log(u))` for `token_uniforms(keys, token_ids)`, minus a Gumbel sample.

    argmax of `logit / T - neg_gumbel` over a set of tokens draws from softmax(logit / T)
    restricted to that set (the Gumbel-max trick), with no normalisation or sort.
    """
    uniforms = token_uniforms(keys, token_ids)
    np.log(uniforms, out=uniforms)
    np.negative(uniforms, out=uniforms)
    np.log(uniforms, out=uniforms)
    return uniforms
