"""Stop strings over streamed text: exact cuts however the text is chunked."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from atlas.domain.batch import SequenceOutput, TokenLogprobs
from atlas.domain.requests import FinishReason, SamplingParams
from atlas.domain.text import IncrementalDetokenizer, StopMatch, StopStringMatcher
from atlas.domain.text.sequence_text import SequenceText, TextDelta
from atlas.domain.text.stop_strings import compile_stops


def run(stops: list[str], chunks: list[str], include: bool = False) -> tuple[str, str | None]:
    """(all emitted text including the flush, the stop that matched)."""
    matcher = StopStringMatcher(stops, include_stop_str_in_output=include)
    emitted, stop = "", None
    for chunk in chunks:
        match = matcher.push(chunk)
        emitted += match.text
        if match.is_stopped:
            stop = match.stop
            break
    return emitted + matcher.flush(), stop


def every_split(text: str) -> list[list[str]]:
    """`text` cut at every pair of positions (cuts may coincide: empty chunks too)."""
    splits = []
    for first in range(len(text) + 1):
        for second in range(first, len(text) + 1):
            splits.append([text[:first], text[first:second], text[second:]])
    return splits


def reference(stops: list[str], text: str, include: bool) -> tuple[str, str | None]:
    """The stop that ends first in the whole text (then the one starting first), by brute force."""
    best = None
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                best = (end - len(stop), stop)
                break
        if best:
            break
    if best is None:
        return text, None
    start, stop = best
    return text[: start + len(stop) if include else start], stop


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_split_anywhere_cuts_at_the_same_place(include: bool) -> None:
    text = "Hello ### world"
    for chunks in every_split(text):
        emitted, stop = run(["###"], chunks, include)
        assert (emitted, stop) == ("Hello ###" if include else "Hello ", "###"), chunks


def test_text_that_may_start_a_stop_is_held_until_it_cannot() -> None:
    matcher = StopStringMatcher(["</answer>"], include_stop_str_in_output=False)
    assert matcher.push("The result is 42 <") == StopMatch("The result is 42 ")
    assert matcher.push("/ans") == StopMatch("")
    assert matcher.push("wer? no") == StopMatch("</answer? no")
    assert matcher.push(" <") == StopMatch(" ")
    assert matcher.flush() == "<"
    assert matcher.flush() == ""


def test_after_a_stop_the_rest_is_dropped() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str_in_output=False)
    first = matcher.push("one two STOP three")
    assert first == StopMatch("one two ", "STOP") and first.is_stopped
    assert matcher.push("four") == StopMatch("", "STOP")
    assert matcher.flush() == ""


def test_overlapping_prefixes_stop_at_the_shorter_one_first() -> None:
    # "ab" completes before "abc" could: a token-by-token stream sees "ab" first.
    for stops in (["ab", "abc"], ["abc", "ab"]):
        assert run(stops, ["xxabc"]) == ("xx", "ab")
        assert run(stops, ["xxa", "bc"]) == ("xx", "ab")
        assert run(stops, ["xxab", "c"], include=True) == ("xxab", "ab")
    # A stop that ends earlier wins even if another started earlier.
    assert run(["abcd", "bc"], ["abcd"]) == ("a", "bc")
    assert run(["abcd", "bc"], ["ab", "cd"]) == ("a", "bc")
    # Same end: the longer (earlier-starting) one.
    assert run(["cd", "bcd"], ["abcd"], include=True) == ("abcd", "bcd")
    assert run(["cd", "bcd"], ["abcd"]) == ("a", "bcd")


def test_several_stops_the_first_in_the_text_wins() -> None:
    stops = ["<|end|>", "\n\n", "User:"]
    assert run(stops, ["Sure.", "\n", "\nUser: hi <|end|>"]) == ("Sure.", "\n\n")
    assert run(stops, ["Sure. Us", "er: <|e", "nd|>"]) == ("Sure. ", "User:")
    assert run(stops, ["Sure. <|e", "nd|> User:"], include=True) == ("Sure. <|end|>", "<|end|>")


def test_a_stop_with_repeated_characters() -> None:
    # The held tail must be the longest possible prefix: "aab" after "aaaab".
    for chunks in (["aaaab"], ["a", "a", "a", "a", "b"], ["aaa", "ab"]):
        assert run(["aab"], chunks) == ("aa", "aab")
    assert run(["aab"], ["aaaa", "c"]) == ("aaaac", None)


def test_multi_character_unicode_stops() -> None:
    assert run(["日本"], ["今日は日", "本です"]) == ("今日は", "日本")
    assert run(["🎉!"], ["yay 🎉", "🎉", "!!"], include=True) == ("yay 🎉🎉!", "🎉!")


def test_no_stops_passes_everything_through_at_once() -> None:
    matcher = StopStringMatcher([], include_stop_str_in_output=False)
    assert matcher.push("anything <|end|>") == StopMatch("anything <|end|>")
    assert matcher.flush() == ""


def test_an_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        StopStringMatcher(["ok", ""], include_stop_str_in_output=False)


@pytest.mark.parametrize("seed", range(40))
def test_random_texts_and_chunkings_match_the_whole_text_answer(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "abc "
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    include = rng.random() < 0.5
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(stops, chunks, include) == reference(stops, text, include), (stops, chunks)


def test_stops_straddling_tokens_through_the_detokenizer() -> None:
    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["the answer is 日本 END of story"] * 20, trainer)

    class Port:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            return tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    text = "The answer: 日本語 ###END### trailing"
    output_ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(Port(), tokenizer.encode("Q:").ids)  # type: ignore[arg-type]
    matcher = StopStringMatcher(["###END", "本語 #!"], include_stop_str_in_output=False)
    emitted, stop = "", None
    for token_id in output_ids:
        match = matcher.push(detokenizer.push([token_id]))
        emitted += match.text
        if match.is_stopped:
            stop = match.stop
            break
    assert (emitted, stop) == ("The answer: 日本語 ", "###END")
    assert not any("###END" in tokenizer.decode([token_id]) for token_id in output_ids)  # it straddled


@pytest.mark.parametrize("seed", range(40))
def test_long_self_overlapping_stops_match_the_whole_text_answer(seed: int) -> None:
    # Periodic stops ("abab...", "aaab") are where prefix tables earn their keep.
    rng = random.Random(1000 + seed)
    alphabet = "ab"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    include = rng.random() < 0.5
    cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert run(stops, chunks, include) == reference(stops, text, include), (stops, chunks)


def test_a_megabyte_stop_string_costs_its_length_not_its_square() -> None:
    # The old matcher kept every prefix of every stop: 1 MB of stop string grew to ~500 GB.
    stop = "ab" * (1 << 19)
    compiled = compile_stops((stop,))
    assert len(compiled.failures[0]) == len(stop) and compiled.failures[0].itemsize == 4
    matcher = StopStringMatcher([stop], include_stop_str_in_output=False)
    emitted = "".join(matcher.push("ab" * 4096).text for _ in range(127))  # one push short of the stop
    assert emitted == "" and matcher.push("x").text == "ab" * (127 * 4096) + "x"
    assert run([stop], ["zz" + stop[:1000], stop[1000:] + "tail"]) == ("zz", stop)


def test_the_held_tail_is_never_longer_than_the_longest_stop_minus_one() -> None:
    matcher = StopStringMatcher(["aaaab", "abc"], include_stop_str_in_output=False)
    assert matcher.push("a" * 10) == StopMatch("a" * 6)  # holds "aaaa", a prefix of "aaaab"
    assert matcher.push("cab") == StopMatch("aaaac")  # holds "ab", a prefix of "abc"
    assert matcher.push("d") == StopMatch("abd")
    assert matcher.flush() == ""


def test_every_choice_of_a_request_shares_one_compiled_table() -> None:
    first = StopStringMatcher(["</s>", "END"], include_stop_str_in_output=False)
    second = StopStringMatcher(["</s>", "END"], include_stop_str_in_output=True)
    assert first._compiled is second._compiled


class WordTokenizer:
    """Token i is WORDS[i]; the last id is the end of sequence (no text)."""

    WORDS = (" the", " cat", " sat", " on", " mat", ",", "")
    eos_token_ids = frozenset({len(WORDS) - 1})

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.WORDS[token_id] for token_id in token_ids)


def delta_of(token_ids: tuple[int, ...], params: SamplingParams, finish: FinishReason | None = None) -> TextDelta:
    """One engine output carrying `token_ids` (as a verify step's accepted drafts do) after one token."""
    text = SequenceText(WordTokenizer(), [0], params)  # type: ignore[arg-type]
    first = text.apply(SequenceOutput("s", (1,), None, 1, 1, (TokenLogprobs(1, -0.5, ()),)))
    assert first.token_ids == (1,) and first.finish_reason is None
    logprobs = tuple(TokenLogprobs(token_id, -float(index), ()) for index, token_id in enumerate(token_ids))
    return text.apply(SequenceOutput("s", token_ids, finish, 1, 1 + len(token_ids), logprobs))


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_inside_a_several_token_output_cuts_its_tokens_logprobs_and_count_there(include) -> None:
    params = SamplingParams(stop=("sat on",), include_stop_str_in_output=include)
    delta = delta_of((2, 3, 4, 5, 1), params)  # " cat sat on" completes the stop at the third token
    assert delta.text == (" sat on" if include else " ")
    assert (delta.finish_reason, delta.stop_reason, delta.stopped_by_text) == (FinishReason.STOP, "sat on", True)
    assert delta.token_ids == (2, 3) and [lp.token_id for lp in delta.logprobs] == [2, 3]
    assert delta.num_output_tokens == 3  # the first token and these two, as plain decoding would count


def test_a_stop_string_before_the_engines_own_stop_drops_the_tokens_after_it() -> None:
    params = SamplingParams(stop=(" sat",))
    delta = delta_of((2, 3, 6), params, FinishReason.STOP)  # the end-of-sequence token after " sat on"
    assert (delta.text, delta.token_ids, delta.num_output_tokens) == ("", (2,), 2)
    assert (delta.finish_reason, delta.stop_reason, delta.stopped_by_text) == (FinishReason.STOP, " sat", False)
    unstopped = delta_of((2, 3, 6), SamplingParams(stop=("mat",)), FinishReason.STOP)
    assert (unstopped.text, unstopped.token_ids, unstopped.num_output_tokens) == (" sat on", (2, 3, 6), 4)
    assert (unstopped.finish_reason, unstopped.stop_reason) == (FinishReason.STOP, None)
