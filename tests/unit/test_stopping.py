"""Token-level stop rules: eos, stop token ids, min_tokens guard, max_tokens, max_total_tokens."""

from __future__ import annotations

from atlas.domain.requests import FinishReason, Request, SamplingParams
from atlas.domain.sequence import Sequence
from atlas.domain.stopping import stop_reason

EOS_IDS = frozenset({2, 7})
PROMPT = (11, 12, 13)


def make_sequence(max_total_tokens: int = 64, **sampling: object) -> Sequence:
    params = SamplingParams(temperature=0.0, **sampling)
    request = Request(request_id="r", prompt_token_ids=PROMPT, sampling=params, seed=5)
    return Sequence(request, max_total_tokens=max_total_tokens, eos_token_ids=EOS_IDS)


def feed(seq: Sequence, token_ids: list[int]) -> list[FinishReason | None]:
    reasons = []
    for token_id in token_ids:
        seq.append_token(token_id)
        reasons.append(stop_reason(seq))
    return reasons


def test_every_eos_id_stops() -> None:
    assert feed(make_sequence(), [30, 31, 7]) == [None, None, FinishReason.STOP]
    assert feed(make_sequence(), [2]) == [FinishReason.STOP]


def test_ignore_eos_keeps_going_past_eos() -> None:
    assert feed(make_sequence(ignore_eos=True), [2, 7, 30]) == [None, None, None]


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    seq = make_sequence(stop_token_ids=(40, 41), ignore_eos=True)
    assert feed(seq, [2, 40]) == [None, FinishReason.STOP]


def test_prompt_tokens_that_are_eos_do_not_stop() -> None:
    request = Request(request_id="r", prompt_token_ids=(5, 2), sampling=SamplingParams(), seed=1)
    seq = Sequence(request, max_total_tokens=16, eos_token_ids=EOS_IDS)
    assert stop_reason(seq) is None
    assert feed(seq, [9]) == [None]


def test_eos_is_not_honoured_before_min_tokens_outputs_precede_it() -> None:
    seq = make_sequence(min_tokens=2, stop_token_ids=(40,))
    # The sampler bans these ids for the first two outputs; if one slips through, it does not stop.
    assert feed(seq, [2, 40, 7]) == [None, None, FinishReason.STOP]
    assert seq.num_output_tokens == 3


def test_max_tokens_gives_length() -> None:
    seq = make_sequence(max_tokens=3)
    assert feed(seq, [30, 31, 32]) == [None, None, FinishReason.LENGTH]


def test_max_total_tokens_gives_length_before_max_tokens() -> None:
    seq = make_sequence(max_total_tokens=5, max_tokens=10)
    assert feed(seq, [30, 31]) == [None, FinishReason.LENGTH]
    assert seq.num_tokens == 5


def test_eos_on_the_last_allowed_token_is_stop_not_length() -> None:
    seq = make_sequence(max_tokens=2)
    assert feed(seq, [30, 2]) == [None, FinishReason.STOP]
    seq = make_sequence(max_total_tokens=4)
    assert feed(seq, [7]) == [FinishReason.STOP]


def test_min_tokens_equal_to_max_tokens_ends_by_length() -> None:
    seq = make_sequence(min_tokens=2, max_tokens=2)
    assert feed(seq, [30, 2]) == [None, FinishReason.LENGTH]
