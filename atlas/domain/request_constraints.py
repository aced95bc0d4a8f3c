"""From a request's plain-data `OutputConstraint` to the `TokenConstraint` the engine drives.

The front end validates a constraint in the API process (a bad schema is a 400 there); the
engine compiles it again with its own `GrammarCompiler`, because a compiled grammar cannot
cross the process boundary. Sequences of one request (n > 1) carry equal constraints:

    grammars = GrammarCache(compiler)
    constraint = token_constraint(request.constraint, grammars)   # once per sequence

compiles each distinct grammar once and gives every sequence its own matcher.
"""

from __future__ import annotations

import msgspec

from atlas.domain.constraints import TokenConstraint
from atlas.domain.requests import OutputConstraint
from atlas.ports.grammar import CompiledGrammar, ConstraintSpec, GrammarCompiler

DEFAULT_CACHED_GRAMMARS = 64


class GrammarCache:
    """Compiled grammars by spec, the most recent `capacity` of them.

    Equal specs (the n sequences of one request) compile once. Raises what `compile` raises
    (GrammarError naming the field) for an invalid spec.
    """

    def __init__(self, compiler: GrammarCompiler, capacity: int = DEFAULT_CACHED_GRAMMARS) -> None:
        self.compiler = compiler
        self._capacity = capacity
        self._compiled: dict[bytes, CompiledGrammar] = {}

    def compiled(self, spec: ConstraintSpec, field: str) -> CompiledGrammar:
        key = _spec_key(spec, field)
        grammar = self._compiled.pop(key, None)
        if grammar is None:
            grammar = self.compiler.compile(spec, field)
        self._compiled[key] = grammar  # most recently used last
        while len(self._compiled) > self._capacity:
            del self._compiled[next(iter(self._compiled))]
        return grammar


def token_constraint(constraint: OutputConstraint | None, grammars: GrammarCache | None,
                     end_token_ids: frozenset[int] = frozenset(), loose_masks: bool = False) -> TokenConstraint | None:
    """The per-sequence constraint of a request, or None when it has none; `end_token_ids`
    (end-of-sequence) may not end the output inside its reasoning block; `loose_masks` allows
    a grammar's superset masks (`atlas.domain.constraints`).

    Raises ValueError when the request has a grammar but the engine has no compiler.
    """
    if constraint is None:
        return None
    matcher = None
    if constraint.grammar is not None:
        if grammars is None:
            raise ValueError(f"{constraint.grammar_field}: this engine has no grammar compiler")
        matcher = grammars.compiled(constraint.grammar, constraint.grammar_field).new_matcher()
    return TokenConstraint(matcher, constraint.reasoning, constraint.starts_in_reasoning, constraint.thinking_budget,
                           end_token_ids, loose_masks=loose_masks)


def _spec_key(spec: ConstraintSpec, field: str) -> bytes:
    return msgspec.msgpack.encode((field, spec))
