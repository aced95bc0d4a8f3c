"""A fake grammar a random model follows only through its masks, and a compiler for it.

`Regex("residues 9")` compiles to a grammar that allows, at output position i, the ids below 90
congruent to i modulo 3, and after 9 tokens only end-of-sequence; `Regex("residues 20 lying
17")` also lets its mask allow id 17, which `accept_token` then refuses (a broken grammar, as a
sampler ignoring the mask would expose); `Regex("residues 20 gives-up 5")` raises
GrammarLimitError on the accept at position 5 and is unusable after (llguidance giving up on a
grammar that compiled); `Regex("residues 9 loose")` carries a `superset` that allows every id
below 90 at each position (the loose masks a bounded JSON string gets). Requests carry it as an
`OutputConstraint`, so the engine goes through its `GrammarCache` as with llguidance.
"""

from __future__ import annotations

import numpy as np
from helpers.tiny_engine import EOS

from atlas.domain.request_constraints import GrammarCache
from atlas.domain.requests import OutputConstraint, ReasoningMarkers
from atlas.ports.grammar import ConstraintSpec, GrammarError, GrammarLimitError, Regex

EOS_ID = next(iter(EOS))


class ResidueGrammar:
    """A GrammarMatcher: position i allows the ids below 90 that are i mod 3; then only eos.
    `modulus` 1 allows every id below 90 (the loose twin)."""

    def __init__(self, length: int, position: int = 0, lying_token: int | None = None, loose: bool = False,
                 modulus: int = 3, gives_up_at: int | None = None) -> None:
        self.length = length
        self.position = position
        self.lying_token = lying_token  # allowed by the mask, refused by accept (a broken grammar)
        self.gives_up_at = gives_up_at  # the accept at this position raises GrammarLimitError
        self.broken = False
        self.modulus = modulus
        self.superset = ResidueGrammar(length, position, modulus=1) if loose else None
        self.num_fills = 0

    def allowed(self) -> list[int]:
        if self.position >= self.length:
            return [EOS_ID]
        ids = [t for t in range(90) if t % self.modulus == self.position % self.modulus]
        return ids + [self.lying_token] if self.lying_token is not None else ids

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        self.num_fills += 1
        bitmask_row[:] = 0
        words = bitmask_row.view(np.uint32)
        for token_id in self.allowed():
            words[token_id >> 5] |= np.uint32(1 << (token_id & 31))

    def accept_token(self, token_id: int) -> bool:
        if self.gives_up_at is not None and (self.broken or self.position == self.gives_up_at):
            self.broken = True
            raise GrammarLimitError("lexer error: too many expressions constructed")
        if token_id == self.lying_token or token_id not in self.allowed():
            self.broken = True
            return False
        self.position += 1
        if self.superset is not None:
            assert self.superset.accept_token(token_id)
        return True

    def allows(self, token_id: int) -> bool:
        return not self.broken and token_id != self.lying_token and token_id in self.allowed()

    def try_accept_token(self, token_id: int) -> bool:
        if self.gives_up_at is not None and (self.broken or self.position == self.gives_up_at):
            return self.accept_token(token_id)  # raises, as llguidance's try does when it gives up
        return self.allows(token_id) and self.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if self.broken and self.gives_up_at is not None:
            raise ValueError("rollback: llguidance refused (the matcher gave up)")
        self.position -= num_tokens
        if self.superset is not None:
            self.superset.rollback(num_tokens)

    def fork(self) -> ResidueGrammar:
        return ResidueGrammar(self.length, self.position, self.lying_token, self.superset is not None, self.modulus,
                              self.gives_up_at)

    @property
    def is_accepting(self) -> bool:
        return self.position >= self.length

    @property
    def is_finished(self) -> bool:
        return self.position > self.length or self.broken


class CompiledResidues:
    def __init__(self, length: int, lying_token: int | None, loose: bool = False,
                 gives_up_at: int | None = None) -> None:
        self.length = length
        self.lying_token = lying_token
        self.loose = loose
        self.gives_up_at = gives_up_at
        self.matchers: list[ResidueGrammar] = []

    def new_matcher(self) -> ResidueGrammar:
        matcher = ResidueGrammar(self.length, lying_token=self.lying_token, loose=self.loose,
                                 gives_up_at=self.gives_up_at)
        self.matchers.append(matcher)
        return matcher


class ResidueCompiler:
    """A GrammarCompiler of residue grammars; `compiled` lists the patterns it compiled."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.compiled: list[str] = []

    def compile(self, spec: ConstraintSpec, field: str) -> CompiledResidues:
        words = spec.pattern.split() if isinstance(spec, Regex) else []
        loose = words[-1:] == ["loose"]
        words = words[:-1] if loose else words
        if len(words) not in (2, 4) or words[0] != "residues":
            raise GrammarError(field, f"not a residue grammar: {spec!r}")
        self.compiled.append(spec.pattern)
        gives_up_at = int(words[3]) if len(words) == 4 and words[2] == "gives-up" else None
        lying = int(words[3]) if len(words) == 4 and words[2] == "lying" else None
        return CompiledResidues(int(words[1]), lying, loose, gives_up_at)

    def fill_bitmasks(self, rows, bitmask: np.ndarray) -> None:
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask[row])


def residue_grammars(vocab_size: int) -> GrammarCache:
    return GrammarCache(ResidueCompiler(vocab_size))


def residues(length: int, lying_token: int | None = None, reasoning: ReasoningMarkers | None = None,
             thinking_budget: int | None = None, loose: bool = False,
             gives_up_at: int | None = None) -> OutputConstraint:
    """The constraint of a residue grammar of `length` tokens (after a reasoning block, with
    `reasoning`, that the prompt opened); `loose` gives its matchers a superset; `gives_up_at`
    a position whose accept raises GrammarLimitError."""
    pattern = f"residues {length}" + (f" lying {lying_token}" if lying_token is not None else "")
    pattern += f" gives-up {gives_up_at}" if gives_up_at is not None else ""
    pattern += " loose" if loose else ""
    return OutputConstraint(Regex(pattern), "response_format", reasoning, reasoning is not None, thinking_budget)


def follows_residues(tokens: list[int], length: int) -> bool:
    body, rest = tokens[:length], tokens[length:]
    return all(t < 90 and t % 3 == i % 3 for i, t in enumerate(body)) and rest in ([], [EOS_ID])
