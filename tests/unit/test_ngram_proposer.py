"""N-gram prompt lookup on crafted sequences: longest size first, most recent match, LZ77 copies."""

from __future__ import annotations

import random

import pytest

from atlas.domain.speculative import NgramIndex, NgramProposer


def index_of(tokens: list[int], min_n: int = 1, max_n: int = 3) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> tuple[int, ...]:
    """The rule, by scanning: longest tail n-gram first, most recent earlier end, copy k."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        tail = tokens[length - n :]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == tail:
                out = list(tokens)
                for offset in range(k):
                    out.append(out[end + offset])
                return tuple(out[length:])
    return ()


def test_the_longest_matching_size_wins_over_a_more_recent_shorter_match() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    # tail "1 2 3" ended at 4 (followed by 9); "2 3" alone ended more recently at 8 (followed by 8)
    assert index_of(tokens).propose(2) == (9, 5)
    assert index_of(tokens, max_n=2).propose(2) == (8, 1)


def test_among_matches_of_one_size_the_most_recent_wins() -> None:
    tokens = [4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5]
    assert index_of(tokens, min_n=2, max_n=2).propose(1) == (3,)


def test_a_periodic_tail_repeats_its_period_past_the_end_of_the_context() -> None:
    assert index_of([1, 2, 3, 1, 2, 3, 1, 2], min_n=2, max_n=4).propose(5) == (3, 1, 2, 3, 1)
    assert index_of([6, 6, 6], min_n=1, max_n=2).propose(4) == (6, 6, 6, 6)


def test_no_match_proposes_nothing_and_the_tail_never_matches_itself() -> None:
    assert index_of([1, 2, 3, 4]).propose(3) == ()
    assert index_of([5]).propose(3) == ()
    assert index_of([1, 2, 1, 2], min_n=3, max_n=3).propose(2) == ()
    assert index_of([1, 2, 1, 2], min_n=2, max_n=3).propose(2) == (1, 2)
    assert NgramIndex(1, 2).propose(2) == ()


def test_incremental_extension_equals_building_at_once_and_the_brute_force_rule() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(4) for _ in range(300)]
    index = NgramIndex(2, 4)
    for length in range(len(tokens)):
        index.extend(tokens[length : length + 1])
        assert index.propose(3) == brute_force(tokens[: length + 1], 2, 4, 3), length
    assert index.num_tokens == len(tokens)


def test_large_token_ids_pack_without_colliding() -> None:
    big = 2**31 - 1
    # "big 0" and "0 big" must be different bigrams; a sloppy packing would merge them.
    assert index_of([big, 0, 9, 0, big], min_n=2, max_n=2).propose(1) == ()
    with pytest.raises(ValueError, match="outside"):
        NgramIndex(1, 2).extend([-1])


class History:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.slices: list[tuple[int, int]] = []  # every read, to check reads are incremental

    @property
    def num_final_tokens(self) -> int:
        return len(self.tokens)

    def tokens_slice(self, start: int, stop: int) -> list[int]:
        self.slices.append((start, stop))
        return self.tokens[start:stop]


def test_the_proposer_reads_only_the_tokens_each_sequence_gained() -> None:
    proposer = NgramProposer(min_n=2, max_n=3, num_speculative_tokens=2)
    history = History([1, 2, 3, 4, 1, 2])
    assert proposer.propose("a", history) == (3, 4)
    history.tokens += [3, 9, 1, 2]
    assert proposer.propose("a", history) == (3, 9)
    assert history.slices == [(0, 6), (6, 10)]
    assert proposer.num_sequences == 1
    proposer.forget("a")
    proposer.forget("never-seen")
    assert proposer.num_sequences == 0


def test_a_history_that_shrinks_is_an_invariant_violation() -> None:
    proposer = NgramProposer(min_n=1, max_n=2, num_speculative_tokens=2)
    history = History([1, 2, 3])
    proposer.propose("a", history)
    history.tokens = [1, 2]
    with pytest.raises(AssertionError, match="finalized"):
        proposer.propose("a", history)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(0, 2, 4)
