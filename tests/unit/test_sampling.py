"""The sampler: host packing, the counter-based stream, and the numpy device op's rules.

Every expected value here is computed independently of the code under test: the random
stream with Python integers, penalties and log-softmax in float64, the race straight from the
`SamplingTensors` formula.
"""

from __future__ import annotations


import msgspec

import numpy as np
import pytest

from atlas.adapters.mock.sampler import apply_penalties_and_bias, sample_rows
from atlas.domain.batch import SamplingRow
from atlas.domain.requests import ParameterError, Request, SamplingParams
from atlas.domain.sequence import Sequence
from atlas.domain.sampling import (
    PackedSampling,
    RowPacker,
    counter_uniforms,
    pack_rows,
    sampling_row,
    sampling_rows,
    validate_token_ids,
)

MASK = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
TOKEN_MIX = 0xD1B54A32D192ED03
MUL_1 = 0xBF58476D1CE4E5B9
MUL_2 = 0x94D049BB133111EB


def reference_bits(seed: int, counter: int, token_id: int) -> int:
    """splitmix64 of the row/token key, in Python integers (the contract, written out)."""
    x = (seed ^ (counter * GOLDEN) ^ (token_id * TOKEN_MIX)) & MASK
    x = (x + GOLDEN) & MASK
    x = ((x ^ (x >> 30)) * MUL_1) & MASK
    x = ((x ^ (x >> 27)) * MUL_2) & MASK
    return x ^ (x >> 31)


def reference_uniform(seed: int, counter: int, token_id: int) -> float:
    return ((reference_bits(seed, counter, token_id) >> 41) + 0.5) * 2.0**-23


def seed_reaching(bits: int) -> int:
    """The seed whose token 0 at counter 0 hashes to `bits` (splitmix64 is a bijection)."""

    def undo_xor_shift(x: int, shift: int) -> int:
        result = x
        for _ in range(64 // shift + 1):
            result = x ^ (result >> shift)
        return result

    x = undo_xor_shift(bits, 31)
    x = undo_xor_shift((x * pow(MUL_2, -1, 2**64)) & MASK, 27)
    x = undo_xor_shift((x * pow(MUL_1, -1, 2**64)) & MASK, 30)
    return (x - GOLDEN) & MASK


def row(**fields: object) -> SamplingRow:
    values: dict[str, object] = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234, counter=0)
    values.update(fields)
    return SamplingRow(**values)  # type: ignore[arg-type]


def reference_race(logits: np.ndarray, temperature: float, seed: int, counter: int, kept: np.ndarray) -> int:
    """argmax over kept ids of float32 logit / T - log(-log(u)), ties to the lowest id."""
    uniforms = np.array([reference_uniform(seed, counter, int(v)) for v in kept], dtype=np.float32)
    scores = logits[kept].astype(np.float32) / np.float32(temperature) - np.log(-np.log(uniforms))
    return int(kept[np.argmax(scores)])


# -- the random stream ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 987654321, 2**63 + 12345, MASK])
@pytest.mark.parametrize("counter", [0, 1, 77, 2**40 + 3])
def test_counter_uniforms_follow_the_contract_bit_for_bit(seed: int, counter: int) -> None:
    uniforms = counter_uniforms(seed, counter, 300)
    assert uniforms.dtype == np.float32 and uniforms.shape == (300,)
    expected = [reference_uniform(seed, counter, v) for v in range(300)]
    assert uniforms.tolist() == expected  # float32 holds these values exactly


def test_counter_uniforms_extremes_stay_inside_the_open_interval() -> None:
    # Drive the hash to its largest and smallest outputs: u must be exact and never 0 or 1
    # (u = 1 would give log(-log(u)) = -inf, a token that wins every race).
    assert reference_bits(seed_reaching(MASK), 0, 0) == MASK
    assert counter_uniforms(seed_reaching(MASK), 0, 1)[0] == np.float32(1 - 2.0**-24)
    assert counter_uniforms(seed_reaching(0), 0, 1)[0] == np.float32(2.0**-24)
    assert np.isfinite(np.log(-np.log(counter_uniforms(seed_reaching(MASK), 0, 1))))


def test_counter_uniforms_differ_across_counters_and_seeds() -> None:
    base = counter_uniforms(7, 0, 1000)
    assert not np.array_equal(base, counter_uniforms(7, 1, 1000))
    assert not np.array_equal(base, counter_uniforms(8, 0, 1000))
    assert np.array_equal(base, counter_uniforms(7, 0, 1000))
    # A negative seed is its two's-complement bit pattern.
    assert np.array_equal(counter_uniforms(-1, 5, 64), counter_uniforms(MASK, 5, 64))
    assert 0.45 < base.mean() < 0.55


# -- packing -------------------------------------------------------------------------------


def test_pack_rows_lays_out_csr_arrays_and_flags() -> None:
    rows = [
        row(temperature=0.0, seed=MASK, counter=3, repetition_penalty=1.3,
            penalty_token_ids=(5, 9, 2), penalty_output_counts=(0, 2, 1)),
        row(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, counter=11,
            penalty_token_ids=(4,), penalty_output_counts=(1,)),  # penalties neutral: not shipped
        row(temperature=1.5, top_k=2**40, presence_penalty=0.5, frequency_penalty=-0.25,
            penalty_token_ids=(8, 1), penalty_output_counts=(3, 1),
            bias_token_ids=(6, 3), bias_values=(2.5, float("-inf"))),
    ]  # fmt: skip
    packed = pack_rows(rows)
    assert packed.num_rows == 3
    assert (packed.all_greedy, packed.any_penalties, packed.any_bias) == (False, True, True)
    assert packed.temperature.dtype == np.float32 and packed.temperature.tolist() == [0.0, np.float32(0.7), 1.5]
    assert packed.top_k.dtype == np.int32 and packed.top_k.tolist() == [0, 40, 2**31 - 1]
    assert packed.top_p.tolist() == [1.0, np.float32(0.9), 1.0]
    assert packed.min_p.tolist() == [0.0, np.float32(0.05), 0.0]
    assert packed.seeds.dtype == np.int64 and packed.seeds.tolist() == [-1, 1234, 1234]
    assert packed.counters.dtype == np.int64 and packed.counters.tolist() == [3, 11, 0]
    assert packed.repetition_penalty.tolist() == [np.float32(1.3), 1.0, 1.0]
    assert packed.presence_penalty.tolist() == [0.0, 0.0, 0.5]
    assert packed.frequency_penalty.tolist() == [0.0, 0.0, -0.25]
    assert packed.penalty_offsets.dtype == np.int32 and packed.penalty_offsets.tolist() == [0, 3, 3, 5]
    assert packed.penalty_token_ids.dtype == np.int32 and packed.penalty_token_ids.tolist() == [5, 9, 2, 8, 1]
    assert packed.penalty_output_counts.dtype == np.int32 and packed.penalty_output_counts.tolist() == [0, 2, 1, 3, 1]
    assert packed.bias_offsets.dtype == np.int32 and packed.bias_offsets.tolist() == [0, 0, 0, 2]
    assert packed.bias_token_ids.dtype == np.int32 and packed.bias_token_ids.tolist() == [6, 3]
    assert packed.bias_values.dtype == np.float32 and packed.bias_values.tolist() == [2.5, float("-inf")]


def test_pack_rows_of_greedy_rows_without_extras() -> None:
    packed = pack_rows([row(temperature=0.0), row(temperature=0.0, seed=9)])
    assert (packed.all_greedy, packed.any_penalties, packed.any_bias) == (True, False, False)
    assert packed.penalty_offsets.tolist() == [0, 0, 0] and packed.penalty_token_ids.size == 0
    empty = pack_rows([])
    assert empty.num_rows == 0 and empty.penalty_offsets.tolist() == [0]


def test_pack_rows_rejects_inconsistent_rows() -> None:
    with pytest.raises(ValueError, match="penalty_output_counts"):
        pack_rows([row(presence_penalty=1.0, penalty_token_ids=(1, 2), penalty_output_counts=(1,))])
    with pytest.raises(ValueError, match="bias_values"):
        pack_rows([row(bias_token_ids=(1,), bias_values=())])
    with pytest.raises(ValueError, match="seed"):
        pack_rows([row(seed=-5)])


def test_validate_token_ids_names_the_field() -> None:
    validate_token_ids(SamplingParams(logit_bias={99: 1.0}, stop_token_ids=(0, 99)), vocab_size=100)
    with pytest.raises(ParameterError) as error:
        validate_token_ids(SamplingParams(logit_bias={3: 1.0, 100: -2.0}), vocab_size=100)
    assert error.value.field == "logit_bias" and "100" in str(error.value)
    with pytest.raises(ParameterError) as error:
        validate_token_ids(SamplingParams(stop_token_ids=(5, 250)), vocab_size=100)
    assert error.value.field == "stop_token_ids" and "250" in str(error.value)


# -- greedy, penalties, bias ---------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (6, 50)).astype(np.float32)
    logits[2, [7, 31, 44]] = logits[2].max() + 1.0  # a three-way tie for the top
    packed = pack_rows([row(temperature=0.0, seed=s) for s in range(6)])
    token_ids = sample_rows(logits, packed, None).token_ids
    assert token_ids.dtype == np.int32
    assert token_ids.tolist() == np.argmax(logits, axis=1).tolist()
    assert token_ids[2] == 7
    # Greedy rows mixed into a random batch keep their argmax.
    mixed = pack_rows([row(temperature=0.0 if r % 2 else 0.8, seed=r) for r in range(6)])
    mixed_ids = sample_rows(logits, mixed, None).token_ids
    assert mixed_ids[1::2].tolist() == token_ids[1::2].tolist()


def reference_processed(logits: np.ndarray, rows: list[SamplingRow]) -> np.ndarray:
    """Penalties then bias in float64, one token at a time."""
    out = logits.astype(np.float64)
    for r, sampling in enumerate(rows):
        if sampling.has_penalties:
            for token_id, count in zip(sampling.penalty_token_ids, sampling.penalty_output_counts):
                value = out[r, token_id]
                rep = sampling.repetition_penalty
                value = value / rep if value > 0 else value * rep
                if count > 0:
                    value -= sampling.presence_penalty + sampling.frequency_penalty * count
                out[r, token_id] = value
        for token_id, bias in zip(sampling.bias_token_ids, sampling.bias_values):
            out[r, token_id] += bias
    return out


def test_penalties_and_bias_change_logits_as_specified() -> None:
    rng = np.random.default_rng(11)
    logits = rng.normal(0, 3, (4, 40)).astype(np.float32)
    rows = [
        row(repetition_penalty=1.7, penalty_token_ids=(0, 3, 5, 8, 13),
            penalty_output_counts=(0, 0, 2, 1, 0)),
        row(presence_penalty=0.6, frequency_penalty=0.3, penalty_token_ids=(2, 4, 6),
            penalty_output_counts=(1, 3, 5), bias_token_ids=(1, 2), bias_values=(4.0, -1.5)),
        row(repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=-0.2,
            penalty_token_ids=(7, 9, 11, 12), penalty_output_counts=(4, 0, 1, 2)),
        row(bias_token_ids=(39, 20), bias_values=(-7.25, float("-inf"))),
    ]  # fmt: skip
    # Both signs of logit under the repetition penalty, so divide and multiply both run.
    logits[0, [0, 3, 5]] = [2.5, -1.5, 0.75]
    logits[2, [7, 9]] = [-2.0, 3.0]
    expected = reference_processed(logits, rows)
    processed = apply_penalties_and_bias(logits, pack_rows(rows))
    assert processed.dtype == np.float32
    np.testing.assert_allclose(processed, expected, rtol=1e-6, atol=1e-6)
    assert processed[3, 20] == -np.inf
    assert not np.array_equal(processed, logits)
    assert np.array_equal(logits[0, [0, 3, 5]], np.float32([2.5, -1.5, 0.75]))  # input untouched


def test_penalties_steer_greedy_choice() -> None:
    logits = np.float32([[1.0, 3.0, 2.9, 0.5]])
    # Token 1 repeated 2x in the output: 3.0 - (0.05 + 0.05 * 2) = 2.85 < 2.9.
    penalised = row(temperature=0.0, presence_penalty=0.05, frequency_penalty=0.05,
                    penalty_token_ids=(1,), penalty_output_counts=(2,))  # fmt: skip
    assert sample_rows(logits, pack_rows([penalised]), None).token_ids.tolist() == [2]
    # Seen only in the prompt: presence/frequency do not apply, repetition does (3.0 / 1.1).
    prompt_only = row(temperature=0.0, repetition_penalty=1.1, presence_penalty=2.0,
                      penalty_token_ids=(1,), penalty_output_counts=(0,))  # fmt: skip
    assert sample_rows(logits, pack_rows([prompt_only]), None).token_ids.tolist() == [2]
    mild = msgspec.structs.replace(prompt_only, repetition_penalty=1.02)  # 3.0 / 1.02 > 2.9
    assert sample_rows(logits, pack_rows([mild]), None).token_ids.tolist() == [1]


def test_a_minus_inf_bias_bans_a_token() -> None:
    logits = np.float32([[0.5, 4.0, 3.9, 0.0, -1.0]])
    banned = row(bias_token_ids=(1,), bias_values=(float("-inf"),))
    assert sample_rows(logits, pack_rows([msgspec.structs.replace(banned, temperature=0.0)]), None).token_ids[0] == 2
    rows = [msgspec.structs.replace(banned, counter=c, temperature=2.0) for c in range(400)]
    drawn = sample_rows(np.repeat(logits, 400, axis=0), pack_rows(rows), None).token_ids
    assert 1 not in drawn.tolist()
    assert set(drawn.tolist()) == {0, 2, 3, 4}  # at T=2 every other token turns up


def test_min_tokens_bans_eos_until_reached() -> None:
    eos = 3
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=8)
    seq = Sequence(Request("r", (5, 6, 7), params, seed=42), max_total_tokens=64, eos_token_ids=frozenset({eos}))
    logits = np.float32([[0.0, 1.0, 0.5, 9.0, 2.0, 0.0, 0.0, 0.0]])  # eos is the clear favourite
    picked = []
    for _ in range(3):
        token_id = int(sample_rows(logits, pack_rows([sampling_row(seq)]), None).token_ids[0])
        picked.append(token_id)
        seq.append_token(token_id)
    assert picked == [4, 4, eos]


# -- the random draw -----------------------------------------------------------------------


def test_random_draws_match_the_contract_race() -> None:
    # Spread-out logits so most tokens are too far behind to win: the sampler skips hashing
    # them, which must not change a single draw.
    rng = np.random.default_rng(5)
    vocab_size = 400
    logits = rng.normal(0, 6, vocab_size).astype(np.float32)
    rows = [row(temperature=t, seed=99, counter=c) for c in range(60) for t in (0.6, 1.0, 1.7)]
    drawn = sample_rows(np.tile(logits, (len(rows), 1)), pack_rows(rows), None).token_ids
    every_id = np.arange(vocab_size)
    expected = [reference_race(logits, r.temperature, r.seed, r.counter, every_id) for r in rows]
    assert drawn.tolist() == expected
    assert len(set(expected)) > 10


def reference_kept(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The filter rules in float64, written plainly: a full stable sort."""
    order = np.argsort(-logits.astype(np.float64), kind="stable")  # descending, ties: lowest id
    if top_k:
        order = order[:top_k]
    scaled = logits[order].astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    preceding = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    keep = preceding < top_p
    keep &= np.exp(scaled - scaled.max()) >= min_p
    return np.sort(order[keep])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [(1.0, 5, 1.0, 0.0), (0.8, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.2), (0.7, 12, 0.85, 0.02), (2.0, 300, 0.97, 0.0)],
)
def test_filtered_draws_match_the_contract_race(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    rng = np.random.default_rng(17)
    logits = rng.normal(0, 2, 500).astype(np.float32)
    kept = reference_kept(logits, temperature, top_k, top_p, min_p)
    assert 1 < kept.size < 500
    rows = [row(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=5, counter=c) for c in range(80)]
    drawn = sample_rows(np.tile(logits, (80, 1)), pack_rows(rows), None).token_ids
    assert drawn.tolist() == [reference_race(logits, temperature, 5, c, kept) for c in range(80)]


def test_top_k_ties_at_the_cut_keep_the_lowest_ids() -> None:
    logits = np.float32([0.0, 2.0, 1.0, 1.0, 3.0, 1.0, 1.0, -1.0])
    rows = [row(top_k=4, temperature=5.0, counter=c) for c in range(500)]
    drawn = sample_rows(np.tile(logits, (500, 1)), pack_rows(rows), None).token_ids
    assert set(drawn.tolist()) == {1, 2, 3, 4}  # of the four 1.0s, ids 2 and 3


def test_same_seed_and_counter_give_the_same_token_whatever_the_batch() -> None:
    rng = np.random.default_rng(23)
    vocab_size = 256
    target_logits = rng.normal(0, 1, vocab_size).astype(np.float32)
    targets = [
        row(temperature=1.0, seed=2024, counter=9),
        row(temperature=0.9, top_k=50, seed=7, counter=100),
        row(temperature=1.1, top_p=0.8, min_p=0.01, seed=2**63 + 1, counter=3),
    ]
    for target in targets:
        alone = sample_rows(target_logits[None, :], pack_rows([target]), None).token_ids[0]
        others = [
            row(temperature=0.0),
            row(temperature=0.5, top_k=3, seed=target.seed, counter=target.counter + 1),
            row(temperature=1.0, presence_penalty=1.0, penalty_token_ids=(1, 2), penalty_output_counts=(1, 1)),
            row(temperature=2.0, bias_token_ids=(0,), bias_values=(5.0,)),
        ]
        batch_rows = others[:2] + [target] + others[2:]
        batch_logits = rng.normal(0, 1, (5, vocab_size)).astype(np.float32)
        batch_logits[2] = target_logits
        in_batch = sample_rows(batch_logits, pack_rows(batch_rows), None).token_ids[2]
        assert in_batch == alone


def test_counters_and_seeds_give_different_draws() -> None:
    logits = np.random.default_rng(1).normal(0, 0.5, 1000).astype(np.float32)  # nearly flat
    by_counter = [row(seed=31, counter=c) for c in range(40)]
    drawn = sample_rows(np.tile(logits, (40, 1)), pack_rows(by_counter), None).token_ids
    assert len(set(drawn.tolist())) >= 35
    by_seed = [row(seed=s, counter=0) for s in range(40)]
    drawn_by_seed = sample_rows(np.tile(logits, (40, 1)), pack_rows(by_seed), None).token_ids
    assert len(set(drawn_by_seed.tolist())) >= 35
    again = sample_rows(np.tile(logits, (40, 1)), pack_rows(by_counter), None).token_ids
    assert np.array_equal(drawn, again)


def test_a_row_with_every_token_banned_returns_its_argmax() -> None:
    logits = np.float32([[1.0, 2.0, 3.0]])
    everything = row(top_k=2, bias_token_ids=(0, 1, 2), bias_values=(float("-inf"),) * 3)
    assert sample_rows(logits, pack_rows([everything]), None).token_ids.tolist() == [0]


def test_persistent_buffers_longer_than_the_step_are_read_up_to_num_rows() -> None:
    rng = np.random.default_rng(8)
    logits = rng.normal(0, 1, (5, 64)).astype(np.float32)
    rows = [
        row(temperature=0.7, seed=r, counter=r, presence_penalty=0.5, penalty_token_ids=(r,),
            penalty_output_counts=(1,), bias_token_ids=(r + 10,), bias_values=(1.0,))
        for r in range(5)
    ]  # fmt: skip
    step = msgspec.structs.replace(pack_rows(rows), num_rows=3)
    assert np.array_equal(
        sample_rows(logits[:3], step, 2).token_ids, sample_rows(logits[:3], pack_rows(rows[:3]), 2).token_ids
    )


def test_shape_and_id_errors_name_the_argument() -> None:
    packed = pack_rows([row(), row()])
    with pytest.raises(ValueError, match="logits"):
        sample_rows(np.ones((3, 8), np.float32), packed, None)
    biased = pack_rows([row(bias_token_ids=(8,), bias_values=(1.0,))])
    with pytest.raises(ValueError, match="bias_token_ids"):
        sample_rows(np.ones((1, 8), np.float32), biased, None)


# -- logprobs ------------------------------------------------------------------------------


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    wide = logits.astype(np.float64)
    shifted = wide - wide.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def test_logprobs_are_the_raw_log_softmax() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 4, (5, 300)).astype(np.float32)
    logits[3, [10, 20, 30]] = logits[3].max() + 2.0  # tie at the top: lowest ids first
    rows = [
        row(temperature=0.0),
        row(temperature=0.9, top_k=20),
        row(temperature=1.0, repetition_penalty=2.0, penalty_token_ids=tuple(range(50)),
            penalty_output_counts=(1,) * 50, bias_token_ids=(299,), bias_values=(30.0,)),
        row(temperature=0.0),
        row(temperature=1.5, top_p=0.5),
    ]  # fmt: skip
    out = sample_rows(logits, pack_rows(rows), 6)
    expected = reference_log_softmax(logits)
    assert out.sampled_logprobs.dtype == np.float32 and out.top_logprobs.dtype == np.float32
    assert out.top_ids.dtype == np.int32 and out.top_ids.shape == (5, 6)
    reference_top = np.argsort(-expected, axis=1, kind="stable")[:, :6]
    assert out.top_ids.tolist() == reference_top.tolist()
    assert out.top_ids[3, :3].tolist() == [10, 20, 30]
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(expected, reference_top, 1), atol=2e-5)
    np.testing.assert_allclose(out.sampled_logprobs, expected[np.arange(5), out.token_ids], atol=2e-5)
    assert out.token_ids[2] == 299  # the bias steered the draw; the logprob stayed the raw one
    assert out.sampled_logprobs[2] < -5


def test_logprobs_only_when_asked() -> None:
    logits = np.random.default_rng(6).normal(0, 1, (2, 40)).astype(np.float32)
    packed = pack_rows([row(), row(temperature=0.0)])
    none = sample_rows(logits, packed, None)
    assert none.sampled_logprobs is None and none.top_ids is None and none.top_logprobs is None
    only_sampled = sample_rows(logits, packed, 0)
    assert only_sampled.top_ids.shape == (2, 0)
    assert np.array_equal(only_sampled.token_ids, none.token_ids)
    np.testing.assert_allclose(
        only_sampled.sampled_logprobs, reference_log_softmax(logits)[[0, 1], none.token_ids], atol=1e-5
    )


def test_a_verify_step_samples_each_draft_position_as_if_the_drafts_were_output() -> None:
    """Row j of a sequence verifying drafts: counter c + j, penalty counts with drafts[:j],
    and eos banned while c + j < min_tokens."""
    params = SamplingParams(temperature=0.7, max_tokens=20, min_tokens=3, repetition_penalty=1.2, frequency_penalty=0.5)
    seq = Sequence(Request("s", (4, 5), params, seed=9), max_total_tokens=22, eos_token_ids=frozenset({0}))
    seq.append_token(5)  # one output token: c = 1
    seq.add_drafts((6, 5, 6))
    rows = sampling_rows(seq)
    assert [row.counter for row in rows] == [1, 2, 3, 4]
    counts = [dict(zip(row.penalty_token_ids, row.penalty_output_counts)) for row in rows]
    assert counts == [{4: 0, 5: 1}, {4: 0, 5: 1, 6: 1}, {4: 0, 5: 2, 6: 1}, {4: 0, 5: 2, 6: 2}]
    assert [0 in row.bias_token_ids for row in rows] == [True, True, False, False]  # c + j < 3
    plain = Sequence(Request("p", (4, 5), params, seed=9), max_total_tokens=22, eos_token_ids=frozenset({0}))
    plain.append_token(5)
    assert sampling_rows(plain) == rows[:1]  # without drafts: the first row alone


def test_a_sequences_rows_built_from_its_cached_base_equal_rows_built_afresh() -> None:
    """Past min_tokens a row without drafts or penalties is the sequence's cached base with
    the step's counter: every field must match the row a sequence with no cache builds from
    the parameters, across the min_tokens edge; drafts still get a row per position."""
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, min_tokens=2, max_tokens=20,
                            logit_bias={7: 1.5}, stop_token_ids=[9], logprobs=2)
    request = Request("s", (4, 5, 6), params, seed=-3)
    seq = Sequence(request, max_total_tokens=30, eos_token_ids=frozenset({0}))
    for token_id in (11, 12, 13, 14):
        afresh = Sequence(request, max_total_tokens=30, eos_token_ids=frozenset({0}))
        for earlier in seq.output_token_ids:
            afresh.append_token(earlier)
        assert sampling_rows(seq) == sampling_rows(afresh)
        seq.append_token(token_id)
    assert seq.sampling_row_base is not None and seq.sampling_row_base.bias_token_ids == (7,)
    [late] = sampling_rows(seq)
    assert (late.counter, late.seed, late.bias_values, late.num_logprobs, late.top_k) == (4, 2**64 - 3, (1.5,), 2, 40)
    seq.add_drafts((15, 16))
    assert [row.counter for row in sampling_rows(seq)] == [4, 5, 6]


def test_a_row_packer_packs_every_step_as_pack_rows_does():
    """Steps that only advance the counters reuse the arrays of the last step with as many rows;
    rows changing, leaving, joining or moving, and steps of other sizes in between (a lone
    sequence's one-row and padded verify steps alternate), must never leave a stale field."""
    rng = np.random.default_rng(3)
    pool = [row(temperature=float(t), top_k=int(k), seed=int(s), bias_token_ids=(1,) if b else (),
                bias_values=(2.0,) if b else ())
            for t, k, s, b in zip(rng.uniform(0, 2, 9), rng.integers(0, 50, 9), rng.integers(0, 2**63, 9),
                                  rng.random(9) < 0.3)]
    packer = RowPacker()
    rows = pool[:4]
    side = [pool[5]]  # packed between some steps: another size, or rows' size with other rows
    for step in range(120):
        if step % 7 == 3:
            rows = [pool[int(i)] for i in rng.choice(len(pool), size=int(rng.integers(0, 7)), replace=False)]
        elif step % 7 == 5 and rows:  # one row changed but for its seed and counter (a ban lifted, say)
            index = int(rng.integers(0, len(rows)))
            rows[index] = msgspec.structs.replace(rows[index], temperature=0.0, min_p=0.2, bias_token_ids=(),
                                                  bias_values=())
        if step % 11 == 4:
            side = [pool[int(i)] for i in rng.choice(len(pool), size=int(rng.integers(1, 8)), replace=False)]
        rows = [msgspec.structs.replace(r, counter=r.counter + 1) for r in rows]
        side = [msgspec.structs.replace(r, counter=r.counter + 2) for r in side]
        for batch in [rows, side] if step % 3 else [rows]:
            packed, expected = packer.pack(batch), pack_rows(batch)
            for name in PackedSampling.__struct_fields__:
                actual, wanted = getattr(packed, name), getattr(expected, name)
                if isinstance(wanted, np.ndarray):
                    assert actual.dtype == wanted.dtype, name
                    np.testing.assert_array_equal(actual, wanted, err_msg=name)
                else:
                    assert actual == wanted, name
