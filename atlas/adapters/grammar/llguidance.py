"""The grammar port on llguidance: Earley parsing over a token trie, masks computed in Rust.

llguidance reads the tokenizer from its tokenizer.json text (byte-level BPE, SentencePiece
byte fallback and added tokens handled on its side) and writes a mask as 32 allowed-bits per
int32 word, the layout `atlas.ports.grammar` fixes. Computing a mask drops the GIL, so a worker
thread can fill the next step's masks while the device runs the current one, and
`fill_bitmasks` spreads a batch over llguidance's own thread pool.

JSON comes out in json.dumps' compact style (", " and ": ", no other whitespace): it is what
models write, and a model cannot loop on whitespace inside a value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import llguidance
import numpy as np

from atlas.adapters.grammar.counted_strings import CountedString, counts_strings, StringTables
from atlas.adapters.grammar.relaxed_schema import relaxed_schema
from atlas.adapters.grammar.tool_call_grammars import JSON_STYLE, tool_call_lark
from atlas.domain.token_mask import allow_only
from atlas.ports.grammar import (
    Choice,
    ConstraintSpec,
    ForcedToolCalls,
    Grammar,
    GrammarError,
    GrammarLimitError,
    GrammarMatcher,
    JsonObject,
    JsonSchema,
    Regex,
)


class LlguidanceMatcher:
    """One sequence's llguidance matcher (the `GrammarMatcher` port), with the matcher of its
    schema's relaxed grammar kept in step where it has one (`superset`). A superset may count
    down the string being written (`counted`, `atlas.adapters.grammar.counted_strings`): its
    masks then drop the tokens too long for what the string has left.

    End-of-sequence is taken here, not by llguidance: its validate and try-consume never take
    it (so a row that ended its document read as refused and was sampled again), and its
    consume on a matcher already stopped records nothing, so a rollback of that token undid the
    one before. Where the matcher is accepting, end-of-sequence is allowed and accepted as an
    end marker (`_ended`) that a rollback takes back first; nothing follows it."""

    __slots__ = ("_matcher", "_num_words", "_num_accepted", "_superset", "_counted", "_eos", "_ended")

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, num_accepted: int = 0,
                 superset: LlguidanceMatcher | None = None, counted: CountedString | None = None,
                 eos: frozenset[int] = frozenset(), ended: int = 0) -> None:
        self._matcher = matcher
        self._eos = eos  # the tokenizer's end-of-sequence ids
        self._ended = ended  # end-of-sequence tokens accepted (the last of `_num_accepted`)
        self._num_words = num_words  # ceil(V / 32)
        self._num_accepted = num_accepted
        self._superset = superset
        self._counted = counted

    @property
    def native(self) -> llguidance.LLMatcher:
        """The llguidance matcher (for the batched fill)."""
        return self._matcher

    @property
    def superset(self) -> LlguidanceMatcher | None:
        return self._superset

    @property
    def has_ended(self) -> bool:
        """Whether end-of-sequence was accepted (nothing may follow it)."""
        return self._ended > 0

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        """Write the allowed next tokens into an int32 row; ValueError on a wrong row."""
        if (bitmask_row.dtype != np.int32 or bitmask_row.shape != (self._num_words,)
                or not bitmask_row.flags.c_contiguous):
            raise ValueError(f"bitmask_row: expected C-contiguous int32 [{self._num_words}], got "
                             f"{bitmask_row.dtype} {list(bitmask_row.shape)}")
        if self._ended:
            allow_only(bitmask_row, self._eos)  # nothing follows the end (a draft past it, say)
            return
        self._matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)
        if self._counted is not None and (keep := self._counted.keep) is not None:
            np.bitwise_and(bitmask_row, keep, out=bitmask_row)

    @property
    def counted(self) -> CountedString | None:
        return self._counted

    def allows(self, token_id: int) -> bool:
        if self._ended:
            return False
        if token_id in self._eos:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token_id]) == 1

    def accept_token(self, token_id: int) -> bool:
        """Advance past `token_id`; False, the matcher unmoved, when the grammar forbids it.
        GrammarLimitError when llguidance gives up on the matcher (a lexer limit)."""
        return self.try_accept_token(token_id)

    def try_accept_token(self, token_id: int) -> bool:
        """Advance past `token_id` where the grammar allows it; False, the matcher unmoved and
        usable, where it does not. One native call for `allows` and `accept_token` (a
        constrained step accepts a token a row on the path to its next masks). A refusal
        leaves the matcher without an error; an error means llguidance gave up on it (its
        lexer built too many expressions, say: a pattern intersected with a large length
        bound): GrammarLimitError."""
        if self._ended:  # nothing follows the end (llguidance never saw it: ask it nothing)
            return False
        matcher = self._matcher
        if matcher.try_consume_tokens([token_id]) != 1:
            if matcher.is_error():
                raise GrammarLimitError(_first_line(matcher.get_error()))
            if token_id not in self._eos or not matcher.is_accepting():
                return False
            self._ended += 1  # the end of the output, where the grammar may end (class doc)
            self._num_accepted += 1
            return True
        return self._accepted(token_id)

    def _accepted(self, token_id: int) -> bool:
        """The rest of an accept once the matcher took `token_id`: the superset follows (its
        consume inlined: a row's accept is on the path to the next step's masks)."""
        self._num_accepted += 1
        superset = self._superset
        if superset is not None:
            if not superset._matcher.consume_token(token_id):  # refused, or a limit of its own
                self._superset = None  # not looser after all here: exact masks from now on
            else:
                superset._num_accepted += 1
                if superset._counted is not None:
                    superset._counted.advance(token_id, self._matcher, superset._matcher)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens; ValueError past the start."""
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"rollback: {num_tokens} tokens asked back, {self._num_accepted} accepted")
        self._num_accepted -= num_tokens
        ended = min(num_tokens, self._ended)  # the end came last: it goes first, llguidance never saw it
        self._ended -= ended
        num_tokens -= ended
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"rollback: llguidance refused ({self._matcher.get_error()})")
        if self._superset is not None:
            self._superset.rollback(num_tokens)
        if self._counted is not None:
            self._counted.rollback(num_tokens)

    def fork(self) -> LlguidanceMatcher:
        superset = self._superset.fork() if self._superset is not None else None
        counted = self._counted.copy() if self._counted is not None else None
        return LlguidanceMatcher(self._matcher.deep_copy(), self._num_words, self._num_accepted, superset, counted,
                                 self._eos, self._ended)

    @property
    def is_accepting(self) -> bool:
        return bool(self._ended) or self._matcher.is_accepting()

    @property
    def is_finished(self) -> bool:
        return bool(self._ended) or self._matcher.is_stopped()


class LlguidanceGrammar:
    """A validated grammar (the `CompiledGrammar` port)."""

    __slots__ = ("_tokenizer", "_grammar", "_field", "_vocab_size", "_start", "_relaxed", "_counter", "_eos")

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, field: str, vocab_size: int,
                 relaxed: Callable[[], str] | None = None,
                 counter: Callable[[], CountedString | None] | None = None) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._field = field
        self._vocab_size = vocab_size
        self._start: llguidance.LLMatcher | None = None  # built by the first new_matcher
        self._eos = frozenset(tokenizer.eos_tokens)
        # A looser grammar whose masks are cheaper (`relaxed_schema`): its text's maker until
        # the first matcher needs it (the API process compiles only to validate), then itself.
        self._relaxed: Callable[[], str] | LlguidanceGrammar | None = relaxed
        self._counter = counter  # a new superset's string counter (None: its masks as they are)

    def new_matcher(self) -> LlguidanceMatcher:
        """A matcher at the start; GrammarError if llguidance rejects the (validated) grammar.

        The first call builds a matcher from the grammar's text (~0.4-0.8 ms for a JSON schema
        on a 49k vocabulary); later ones copy it (~1 us), which matters when short constrained
        requests start every few steps."""
        if self._start is None:
            matcher = llguidance.LLMatcher(self._tokenizer, self._grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(self._field, matcher.get_error())
            self._start = matcher
        superset = None
        if self._relaxed is not None:
            try:
                if not isinstance(self._relaxed, LlguidanceGrammar):
                    self._relaxed = LlguidanceGrammar(self._tokenizer, self._relaxed(), self._field, self._vocab_size)
                superset = self._relaxed.new_matcher()
                superset._counted = self._counter() if self._counter is not None else None
            except (GrammarError, ValueError):  # exact masks only
                self._relaxed = None
        return LlguidanceMatcher(self._start.deep_copy(), (self._vocab_size + 31) // 32, superset=superset,
                                 eos=self._eos)


class LlguidanceCompiler:
    """Compiles constraint specs for one tokenizer (the `GrammarCompiler` port).

    `tokenizer_json` is the text of the model's tokenizer.json; `vocab_size` the logit width
    (a model may have more embedding rows than tokens; those ids are never allowed).
    `token_id` looks up a special token's id by its text (None when the vocabulary lacks it).
    Building the token trie takes a fraction of a second: make one compiler per model.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        token_id: Callable[[str], int | None],
        num_threads: int | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("eos_token_ids: a grammar needs the end-of-sequence ids to end the output")
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._vocab_size = vocab_size
        self._token_id = token_id
        # A step's 16 masks on a 16-core H100 host, median us: llguidance's default pool (80% of
        # the cores) 255-296 for small JSON-schema masks and 1,033-1,226 for counted strings;
        # two threads 132-150 and 236-264 (benchmarks/host_masks.py's notes, docs/lab).
        self._num_threads = num_threads if num_threads is not None else 2
        self._executor: llguidance.LLExecutor | None = None
        self._string_tables: StringTables | None = None  # built by the first schema with counted strings

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, spec: ConstraintSpec, field: str) -> LlguidanceGrammar:
        """Validate `spec`; GrammarError naming `field` when it is invalid."""
        grammar = self._grammar_text(spec, field)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(field, _first_line(messages[0]) if messages else "invalid grammar")
        if isinstance(spec, JsonSchema) and spec.strict and messages:
            raise GrammarError(field, f"strict schema uses unsupported features: {'; '.join(messages)}")
        loose = relaxed_schema(spec.schema) if isinstance(spec, JsonSchema) and isinstance(spec.schema, Mapping) else None
        relaxed = None if loose is None else functools.partial(_json_schema_grammar, loose, not spec.strict)
        longest = counts_strings(spec.schema) if loose is not None else None
        counter = None if longest is None else functools.partial(self._new_counter, longest)
        return LlguidanceGrammar(self._tokenizer, grammar, field, self._vocab_size, relaxed, counter)

    def _new_counter(self, longest_bound: int) -> CountedString | None:
        tables = self._string_tables
        if tables is None:
            tokenizer = self._tokenizer
            tables = self._string_tables = StringTables(tokenizer.decode_bytes, tokenizer.is_special_token,
                                                   self._vocab_size, (self._vocab_size + 31) // 32)
        return CountedString(tables, longest_bound) if tables.probe_token is not None else None

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fill the named rows of an int32 [R, W] bitmask on llguidance's thread pool."""
        num_words = (self._vocab_size + 31) // 32
        if (bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[1] != num_words
                or not bitmask.flags.c_contiguous):
            raise ValueError(f"bitmask: expected C-contiguous int32 [R, {num_words}], got {bitmask.dtype} "
                             f"{list(bitmask.shape)}")
        if not rows:
            return
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        # One pass before the native fill and as little as can be after it: a mask thread runs
        # this, and the engine thread waits for its Python on both sides.
        num_rows = bitmask.shape[0]
        native, keeps = [], []
        for matcher, row in rows:
            if not isinstance(matcher, LlguidanceMatcher):
                raise TypeError("fill_bitmasks: matchers must come from this compiler")
            if not 0 <= row < num_rows:
                raise ValueError(f"fill_bitmasks: row {row} outside the bitmask's {num_rows} rows")
            if matcher.has_ended:  # past its end-of-sequence: its own fill (only the end)
                matcher.fill_bitmask(bitmask[row])
                continue
            native.append((matcher.native, row))
            counted = matcher.counted
            if counted is not None and (keep := counted.keep) is not None:
                keeps.append((row, keep))
        if native:
            self._executor.unsafe_compute_mask_ptr(native, bitmask.ctypes.data, bitmask.shape[1] * 4, num_rows)
        for row, keep in keeps:
            np.bitwise_and(bitmask[row], keep, out=bitmask[row])

    # -- specs to llguidance grammars ----------------------------------------------------------

    def _grammar_text(self, spec: ConstraintSpec, field: str) -> str:
        try:
            if isinstance(spec, JsonSchema):
                return _json_schema_grammar(spec.schema, lenient=not spec.strict)
            if isinstance(spec, JsonObject):
                return _json_schema_grammar({"type": "object"}, lenient=False)
            if isinstance(spec, Regex):
                return llguidance.LLMatcher.grammar_from_regex(spec.pattern)
            if isinstance(spec, Choice):
                if not spec.choices:
                    raise GrammarError(field, "choice needs at least one option")
                return llguidance.grammar_from("choice", list(spec.choices))
            if isinstance(spec, Grammar):
                return llguidance.grammar_from("grammar", spec.source)
            if isinstance(spec, ForcedToolCalls):
                return llguidance.LLMatcher.grammar_from_lark(
                    tool_call_lark(spec, self._special_token, self._token_id("[ARGS]") is not None)
                )
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(field, _first_line(str(exc))) from None
        raise TypeError(f"not a constraint spec: {type(spec).__name__}")

    def _special_token(self, text: str) -> str:
        token_id = self._token_id(text)
        return f"<[{token_id}]>" if token_id is not None else f'"{text}"'


def _json_schema_grammar(schema: Mapping[str, Any], lenient: bool) -> str:
    if not isinstance(schema, Mapping):
        raise ValueError("the schema must be a JSON object")
    return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), overrides={**JSON_STYLE, "lenient": lenient})


def _first_line(message: str) -> str:
    """llguidance's message in one line: its first, plus the `error: ...` line where the
    first only announces it (a regex parse error's reason comes after a drawing of the regex)."""
    lines = message.strip().splitlines()
    if not lines:
        return message
    reason = next((line.strip() for line in lines[1:] if line.strip().startswith("error: ")), None)
    if reason is None:
        return lines[0]
    return f"{lines[0].rstrip().removesuffix(':')}: {reason.removeprefix('error: ')}"
