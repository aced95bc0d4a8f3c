"""The grammar port: constraint specs compiled into per-request token matchers.

A request that asks for structured output (`response_format`, `structured_outputs`, a forced
tool call) gets a `ConstraintSpec`. The HTTP side compiles it once per request with
`GrammarCompiler.compile` (an invalid schema, regex or grammar raises `GrammarError` naming the
request field, for a 400) and hands the engine one `GrammarMatcher` per sequence
(`CompiledGrammar.new_matcher`, or `fork` for n > 1 after a shared prefix).

Each step, the engine asks every constrained sequence for its allowed-token bitmask, written
into one row of an int32 array of shape [R, ceil(V / 32)] (bit `v % 32` of word `v // 32` set
means token v is allowed; the layout llguidance and the device sampler share), then feeds the
sampled token back with `accept_token`.

The specs are plain msgspec Structs (tagged by class name), so a request's constraint crosses
from the API process to the engine process as msgpack (`atlas.domain.requests.OutputConstraint`)
and is compiled again there; a compiled grammar never crosses a process boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec
import numpy as np


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `field` names the request field for the 400 reply."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class GrammarLimitError(RuntimeError):
    """The grammar engine gave up on a matcher while it advanced: one of its resource limits
    (a lexer's expressions, say) ran out on a grammar that compiled. The matcher is unusable and
    the request's grammar is too complex as written; the message is the engine's."""


class FunctionTool(msgspec.Struct, frozen=True):
    """A function the model may call: its name and the JSON schema of its arguments object."""

    name: str
    parameters: dict[str, Any] = {}  # {} accepts any object
    description: str = ""


# -- constraint specs ------------------------------------------------------------------------


class JsonSchema(msgspec.Struct, frozen=True, tag=True):
    """Output is one JSON value valid against `schema`. `strict` (OpenAI's flag) makes schema
    keywords the compiler does not implement an error instead of being ignored."""

    schema: dict[str, Any]
    strict: bool = False


class JsonObject(msgspec.Struct, frozen=True, tag=True):
    """Output is one JSON object (OpenAI's `json_object`)."""


class Regex(msgspec.Struct, frozen=True, tag=True):
    """Output matches `pattern` in full (Rust regex syntax)."""

    pattern: str


class Choice(msgspec.Struct, frozen=True, tag=True):
    """Output is exactly one of `choices`."""

    choices: tuple[str, ...]


class Grammar(msgspec.Struct, frozen=True, tag=True):
    """Output derives from a context-free grammar: Lark syntax, or GBNF/EBNF as llama.cpp writes it."""

    source: str


class ForcedToolCalls(msgspec.Struct, frozen=True, tag=True):
    """Output is tool calls in a tool-call parser's markup (`markup` is the parser's name:
    hermes, qwen3_coder, llama3_json, mistral), each calling one of `tools` with arguments valid
    against its schema. One call unless `parallel`, then one or more. `tool_choice` "required"
    passes every tool; a named choice passes that one tool."""

    markup: str
    tools: tuple[FunctionTool, ...]
    parallel: bool = False


ConstraintSpec = JsonSchema | JsonObject | Regex | Choice | Grammar | ForcedToolCalls


# -- matchers ----------------------------------------------------------------------------------


class GrammarMatcher(Protocol):
    """One sequence's position in a compiled grammar.

    Not thread-safe: one thread drives a matcher at a time (the mask for the next token may be
    computed on a worker thread while the device runs the step, as long as nothing else
    touches the matcher meanwhile).

    A matcher may carry a `superset`: a looser grammar kept at the same position (accepting
    every token this one accepts, and moved by `accept_token`, `rollback` and `fork` with it)
    whose masks cost far less to compute. A JSON schema's bounded strings (`maxLength`) make
    llguidance walk the whole vocabulary through a counting lexer, ~0.3-1 ms a mask on a 49k
    vocabulary against ~10 us without the bound. The engine may sample under the superset's
    mask and check the token with `allows` (see `atlas.domain.constraints`).
    """

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        """Write the allowed next tokens into `bitmask_row` (int32 [ceil(V / 32)], C-contiguous).

        Once the grammar is complete only the end-of-sequence ids are allowed. Raises
        ValueError when the row has the wrong shape or dtype.
        """
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and the matcher unusable) when the grammar forbids it.
        Raises GrammarLimitError when the grammar engine gives up on it."""
        ...

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may come next; the matcher does not move."""
        ...

    def try_accept_token(self, token_id: int) -> bool:
        """`accept_token` where the grammar allows `token_id`: True; else False, and the
        matcher stays where it was and usable (`allows` then `accept_token` in one call).
        Raises GrammarLimitError as `accept_token` does."""
        ...

    @property
    def superset(self) -> GrammarMatcher | None:
        """The looser matcher at the same position whose masks are cheaper (None: none)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative drafts).

        Raises ValueError when more tokens are asked back than were accepted.
        """
        ...

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (for n > 1 sequences sharing a prompt)."""
        ...

    @property
    def is_accepting(self) -> bool:
        """True when the text so far is a complete derivation (the sequence may end here)."""
        ...

    @property
    def is_finished(self) -> bool:
        """True when no token but end-of-sequence can follow (complete, or broken by a rejected token)."""
        ...


class CompiledGrammar(Protocol):
    """A validated constraint, ready to start matchers; cheap to keep per request."""

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the start of the output."""
        ...


class GrammarCompiler(Protocol):
    """Compiles constraint specs for one tokenizer and vocabulary width."""

    @property
    def vocab_size(self) -> int:
        """Logit width V the bitmasks cover (ids past the tokenizer's vocabulary are never allowed)."""
        ...

    def compile(self, spec: ConstraintSpec, field: str) -> CompiledGrammar:
        """Validate and compile `spec`.

        Raises GrammarError naming `field` (e.g. "response_format.json_schema.schema") when the
        schema, regex, choice list or grammar is invalid or too complex.
        """
        ...

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fill `bitmask[row]` for every (matcher, row) pair, possibly in parallel.

        `bitmask` is int32 [R, ceil(V / 32)], C-contiguous; rows not named are left untouched.
        The matchers must come from this compiler.
        """
        ...
