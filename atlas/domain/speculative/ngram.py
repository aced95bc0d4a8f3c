"""N-gram prompt lookup: draft the tokens that followed the last time the context's tail occurred.

For a sequence t[0..L) (prompt then output, finalized tokens only) and sizes n in
[min_n, max_n], longest first: find the most recent earlier end e < L with

    t[e-n .. e) == t[L-n .. L)                 (the tail n-gram occurred before, ending at e)

and propose t[e], t[e+1], ... up to k tokens. The copy may run past L into its own output, as an
LZ77 copy does, so a tail that repeats with period P < k proposes the period again:

    t = a b c a b c a b        tail "a b" last ended at e = 5 (L = 8)
    proposal (k = 4): t[5] t[6] t[7] then t[8] = proposal[0] ...  ->  c a b c

Cost: one dict per size maps a packed n-gram to its latest end, so appending a token is
(max_n - min_n + 1) dict writes and a proposal as many lookups plus k reads: never a rescan of
the context (about 1 us each on CPython 3.11). Memory is O(context): about 90 bytes per token
per size (a 32k-token context with sizes 2..4 holds ~9 MB), under 1% of the bytes the same
tokens' K/V take on the device.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

# Token ids are packed 32 bits apiece into one int key: exact, so a hit never needs checking.
_TOKEN_BITS = 32
_TOKEN_LIMIT = 1 << _TOKEN_BITS


class NgramIndex:
    """Where each n-gram of one sequence's finalized tokens last ended (sizes min_n..max_n).

    Only finalized tokens enter (never drafts), so the index never rolls back; a preempted
    sequence keeps its tokens and so its index.
    """

    __slots__ = ("min_n", "max_n", "_tokens", "_last_end")

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n (got {min_n}, {max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # _last_end[n - min_n][packed n-gram] = the largest e < len(_tokens) where it ended
        self._last_end: list[dict[int, int]] = [{} for _ in range(max_n - min_n + 1)]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append finalized tokens. Raises ValueError for an id outside [0, 2**32)."""
        tokens, last_end, min_n = self._tokens, self._last_end, self.min_n
        for token_id in token_ids:
            if not 0 <= token_id < _TOKEN_LIMIT:
                raise ValueError(f"token id {token_id} is outside [0, 2**32)")
            # The n-grams ending where this token starts become matchable only now: the tail
            # itself must never match (it would propose nothing new).
            end = len(tokens)
            key = 0
            for n in range(1, min(self.max_n, end) + 1):
                key |= tokens[end - n] << (_TOKEN_BITS * (n - 1))
                if n >= min_n:
                    last_end[n - min_n][key] = end
            tokens.append(token_id)

    def propose(self, num_tokens: int) -> tuple[int, ...]:
        """Up to `num_tokens` drafts after the longest, most recent earlier match of the tail;
        empty when no tail n-gram of a size in [min_n, max_n] occurred before."""
        tokens = self._tokens
        length = len(tokens)
        end = None
        key = 0
        keys = []
        for n in range(1, min(self.max_n, length) + 1):
            key |= tokens[length - n] << (_TOKEN_BITS * (n - 1))
            keys.append(key)
        for n in range(len(keys), self.min_n - 1, -1):
            end = self._last_end[n - self.min_n].get(keys[n - 1])
            if end is not None:
                break
        if end is None or num_tokens <= 0:
            return ()
        drafts: list[int] = []
        for offset in range(num_tokens):
            source = end + offset
            drafts.append(tokens[source] if source < length else drafts[source - length])
        return tuple(drafts)


class TokenHistory(Protocol):
    """What the proposer reads of a sequence: its finalized tokens (no drafts, no placeholders)."""

    @property
    def num_final_tokens(self) -> int: ...

    def tokens_slice(self, start: int, stop: int) -> list[int]: ...


class NgramProposer:
    """One `NgramIndex` per running sequence, caught up with its finalized tokens on demand."""

    def __init__(self, min_n: int, max_n: int, num_speculative_tokens: int) -> None:
        NgramIndex(min_n, max_n)  # validates the sizes once, here
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = num_speculative_tokens
        self._indexes: dict[str, NgramIndex] = {}
        # seq_id -> (finalized tokens, drafts) of its last proposal: a step asks twice (whether
        # to commit first, then for the drafts) with the same tokens
        self._last: dict[str, tuple[int, tuple[int, ...]]] = {}

    def propose(self, seq_id: str, history: TokenHistory) -> tuple[int, ...]:
        """Drafts for `seq_id`, after indexing the finalized tokens it gained since last time.

        Raises AssertionError when the history holds fewer finalized tokens than were indexed
        (finalized tokens never go away; `forget` a sequence that restarts from scratch).
        """
        num_final = history.num_final_tokens
        last = self._last.get(seq_id)
        if last is not None and last[0] == num_final:
            return last[1]
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        if num_final < index.num_tokens:
            raise AssertionError(f"{seq_id}: {num_final} finalized tokens, but {index.num_tokens} were indexed")
        index.extend(history.tokens_slice(index.num_tokens, num_final))
        drafts = index.propose(self.num_speculative_tokens)
        self._last[seq_id] = (num_final, drafts)
        return drafts

    def forget(self, seq_id: str) -> None:
        """Drop a finished or aborted sequence's index (a no-op for one never seen)."""
        self._indexes.pop(seq_id, None)
        self._last.pop(seq_id, None)

    @property
    def num_sequences(self) -> int:
        return len(self._indexes)
