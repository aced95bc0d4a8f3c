"""Structured output on llguidance with the real SmolLM2 tokenizer.

Masks are checked against brute force over the vocabulary; random walks through the masks
(tokens drawn among the allowed ones, weighted toward tokens that close strings and
structures) must always yield text that parses and validates against the schema; forced tool
calls must parse with the tool-call parser of the same markup into valid calls.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from helpers.checkpoints import smollm2_folder
from helpers.json_schema_check import schema_errors

from atlas.adapters.grammar.llguidance import LlguidanceCompiler
from atlas.domain.constraints import GrammarGaveUp, TokenConstraint, fill_batch_bitmask, fill_step_bitmask
from atlas.domain.reasoning_budget import ReasoningMarkers
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.domain.text.tool_calls import parse_tool_calls
from atlas.ports.grammar import (
    Choice,
    ForcedToolCalls,
    FunctionTool,
    Grammar,
    GrammarError,
    GrammarLimitError,
    JsonObject,
    JsonSchema,
    Regex,
)

FOLDER = smollm2_folder()
pytestmark = pytest.mark.skipif(FOLDER is None, reason="SmolLM2 is not pulled (atlas pull smollm2)")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = FunctionTool("get_weather", {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "hourly": {"type": "boolean"}},
    "required": ["city", "days"],
})
SEARCH = FunctionTool("search", {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 20}, "filters": {
        "type": "object", "properties": {"year": {"type": "integer"}}, "additionalProperties": False}},
    "required": ["query"],
})
NO_ARGS = FunctionTool("now")


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer: HfTokenizer) -> HfTokenizer:
    return smollm2_tokenizer  # tests/unit/conftest.py


@pytest.fixture(scope="module")
def compiler(smollm2_compiler: LlguidanceCompiler) -> LlguidanceCompiler:
    return smollm2_compiler


@pytest.fixture(scope="module")
def token_texts(tokenizer: HfTokenizer) -> list[str]:
    return [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in range(tokenizer.vocab_size)]


@pytest.fixture(scope="module")
def walk_weights(token_texts: list[str]) -> np.ndarray:
    """Tokens that close strings, values or tags are 200x likelier, so walks end in tens of steps."""
    closers = re.compile(r'["}\]>,\n]|^[0-9]$|^(true|false)$')
    closing_tags = "</parameter>\n</function>\n</tool_call>"
    return np.array([200.0 if closers.search(text) or (text and text in closing_tags) else 1.0
                     for text in token_texts])


def allowed_ids(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def random_walk(compiler, tokenizer, spec, weights, rng: np.random.Generator, max_steps: int = 600) -> str:
    """Text of one walk: draw allowed tokens (weighted) until end-of-sequence is drawn."""
    matcher = compiler.compile(spec, "test").new_matcher()
    row = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
    token_ids: list[int] = []
    for _ in range(max_steps):
        matcher.fill_bitmask(row)
        allowed = allowed_ids(row, compiler.vocab_size)
        assert allowed.size, "a live matcher always allows something"
        chosen = int(rng.choice(allowed, p=weights[allowed] / weights[allowed].sum()))
        if chosen in tokenizer.eos_token_ids:
            assert matcher.is_accepting
            return tokenizer.decode(token_ids, skip_special_tokens=False)
        assert matcher.accept_token(chosen)
        token_ids.append(chosen)
    raise AssertionError(f"the walk did not end in {max_steps} steps: {tokenizer.decode(token_ids)!r}")


def test_the_schema_checker_sees_errors() -> None:
    assert schema_errors({"name": "a", "age": -1, "role": "root", "address": {"zip": "1"}, "x": 1}, PERSON) == [
        "$.age: -1 < 0", "$.role: 'root' not in ['admin', 'user']", "$: unexpected key 'x'"]


def test_a_choice_mask_allows_exactly_the_prefixes_of_the_choices(compiler, tokenizer, token_texts) -> None:
    choices = ("yes", "no", "maybe not")
    matcher = compiler.compile(Choice(choices), "structured_outputs.choice").new_matcher()
    row = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
    matcher.fill_bitmask(row)
    expected = [v for v, text in enumerate(token_texts) if text and any(c.startswith(text) for c in choices)]
    assert allowed_ids(row, compiler.vocab_size).tolist() == expected
    for token_id in tokenizer.encode("maybe not", add_special_tokens=False):
        assert matcher.accept_token(token_id)
    matcher.fill_bitmask(row)
    assert allowed_ids(row, compiler.vocab_size).tolist() == sorted(tokenizer.eos_token_ids)
    assert matcher.is_accepting and matcher.is_finished


def test_a_regex_mask_after_a_prefix(compiler, tokenizer, token_texts) -> None:
    matcher = compiler.compile(Regex(r"[0-9]{3}-[a-z]{2}"), "structured_outputs.regex").new_matcher()
    assert matcher.accept_token(tokenizer.encode("1", add_special_tokens=False)[0])
    row = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
    matcher.fill_bitmask(row)
    pattern = re.compile(r"[0-9]{3}-[a-z]{2}")
    expected = [v for v, text in enumerate(token_texts)
                if text and any(pattern.fullmatch("1" + text + tail) for tail in ("", "a", "aa", "-aa", "0-aa"))]
    assert allowed_ids(row, compiler.vocab_size).tolist() == expected
    assert not matcher.is_accepting


def test_ids_past_the_tokenizer_are_never_allowed(tokenizer) -> None:
    wide = LlguidanceCompiler((FOLDER / "tokenizer.json").read_text(), tokenizer.vocab_size + 40,
                              tokenizer.eos_token_ids, tokenizer.token_id)
    row = np.full((wide.vocab_size + 31) // 32, -1, dtype=np.int32)
    wide.compile(JsonObject(), "response_format").new_matcher().fill_bitmask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits[:tokenizer.vocab_size].any() and not bits[tokenizer.vocab_size:].any()


@pytest.mark.parametrize("spec", [JsonSchema(PERSON, strict=True), JsonObject()], ids=["json_schema", "json_object"])
def test_random_walks_give_json_that_validates(compiler, tokenizer, walk_weights, spec) -> None:
    rng = np.random.default_rng(0)
    for _ in range(6):
        text = random_walk(compiler, tokenizer, spec, walk_weights, rng)
        value = json.loads(text)
        schema = spec.schema if isinstance(spec, JsonSchema) else {"type": "object"}
        assert schema_errors(value, schema) == [], text


def test_a_lark_grammar_and_a_gbnf_grammar(compiler, tokenizer, walk_weights) -> None:
    rng = np.random.default_rng(1)
    lark = Grammar('start: "move " DIRECTION (" then " DIRECTION)*\nDIRECTION: "up" | "down"')
    gbnf = Grammar('root ::= "n=" [0-9] [0-9]?')
    for _ in range(4):
        assert re.fullmatch(r"move (up|down)( then (up|down))*", random_walk(compiler, tokenizer, lark, walk_weights, rng))
        assert re.fullmatch(r"n=[0-9]{1,2}", random_walk(compiler, tokenizer, gbnf, walk_weights, rng))


@pytest.mark.parametrize("markup", ["hermes", "qwen3_coder", "llama3_json", "mistral"])
@pytest.mark.parametrize("parallel", [False, True], ids=["single", "parallel"])
def test_forced_tool_calls_parse_into_valid_calls(compiler, tokenizer, walk_weights, markup, parallel) -> None:
    tools = (WEATHER, SEARCH, NO_ARGS)
    rng = np.random.default_rng(2)
    for walk_idx in range(4):
        text = random_walk(compiler, tokenizer, ForcedToolCalls(markup, tools, parallel), walk_weights, rng)
        result = parse_tool_calls(markup, text, tools, random.Random(walk_idx))
        assert result.content == "", text
        assert len(result.tool_calls) >= 1 and (parallel or len(result.tool_calls) == 1), text
        by_name = {tool.name: tool for tool in tools}
        for call in result.tool_calls:
            schema = dict(by_name[call.name].parameters) or {"type": "object"}
            assert schema_errors(json.loads(call.arguments), schema) == [], text


@pytest.mark.parametrize("markup", ["hermes", "qwen3_coder"])
def test_the_newline_after_a_parallel_call_may_end_the_output(compiler, tokenizer, markup) -> None:
    """A model that writes the newline it learnt after a call is not locked into another call."""
    matcher = compiler.compile(ForcedToolCalls(markup, (NO_ARGS,), parallel=True), "tool_choice").new_matcher()
    call = {"hermes": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>\n',
            "qwen3_coder": "<tool_call>\n<function=now>\n</function>\n</tool_call>\n"}[markup]
    for token_id in tokenizer.encode(call, add_special_tokens=False):
        assert matcher.accept_token(token_id), call
    row = np.zeros((compiler.vocab_size + 31) // 32, dtype=np.int32)
    matcher.fill_bitmask(row)
    allowed = {tokenizer.decode([t], skip_special_tokens=False) for t in allowed_ids(row, compiler.vocab_size)}
    assert matcher.is_accepting and "<|im_end|>" in allowed and "<" in allowed


def test_a_named_choice_calls_that_tool(compiler, tokenizer, walk_weights) -> None:
    rng = np.random.default_rng(3)
    for _ in range(3):
        text = random_walk(compiler, tokenizer, ForcedToolCalls("hermes", (SEARCH,)), walk_weights, rng)
        (call,) = parse_tool_calls("hermes", text, (SEARCH,), random.Random(0)).tool_calls
        assert call.name == "search" and "query" in json.loads(call.arguments)


def test_rollback_and_fork_restore_the_same_masks(compiler, tokenizer) -> None:
    grammar = compiler.compile(JsonSchema(PERSON), "response_format")
    matcher = grammar.new_matcher()
    width = (compiler.vocab_size + 31) // 32
    masks = np.zeros((4, width), dtype=np.int32)
    token_ids = tokenizer.encode('{"name": "Ann', add_special_tokens=False)
    matcher.fill_bitmask(masks[0])
    for token_id in token_ids:
        assert matcher.accept_token(token_id)
    matcher.fill_bitmask(masks[1])
    fork = matcher.fork()
    matcher.rollback(len(token_ids))
    matcher.fill_bitmask(masks[2])
    fork.fill_bitmask(masks[3])
    assert np.array_equal(masks[0], masks[2]) and np.array_equal(masks[1], masks[3])
    assert not np.array_equal(masks[0], masks[1])
    with pytest.raises(ValueError, match="rollback"):
        matcher.rollback(1)


def test_the_batched_fill_equals_one_by_one(compiler, tokenizer) -> None:
    specs = [JsonSchema(PERSON), Choice(("a", "b")), Regex("[0-9]+"), JsonObject()]
    matchers = [compiler.compile(spec, "f").new_matcher() for spec in specs]
    assert matchers[0].accept_token(tokenizer.encode("{", add_special_tokens=False)[0])
    width = (compiler.vocab_size + 31) // 32
    batched = np.zeros((6, width), dtype=np.int32)
    compiler.fill_bitmasks([(matcher, row) for row, matcher in zip((5, 0, 2, 3), matchers)], batched)
    for row, matcher in zip((5, 0, 2, 3), matchers):
        single = np.zeros(width, dtype=np.int32)
        matcher.fill_bitmask(single)
        assert np.array_equal(batched[row], single)
    assert not batched[1].any() and not batched[4].any(), "rows not named stay untouched"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (Regex("(("), "unclosed group"),
        (Regex("(a)\\1"), "backreferences are not supported"),
        (JsonSchema({"type": "string", "pattern": "(?=a)a"}), "look-around"),
    ],
)
def test_a_regex_error_says_why_not_only_that_the_regex_did_not_parse(compiler, spec, reason) -> None:
    """llguidance writes the reason lines below "regex parse error:"; the message keeps it."""
    with pytest.raises(GrammarError, match=reason) as error:
        compiler.compile(spec, "structured_outputs.regex")
    assert "\n" not in str(error.value)


def test_a_rejected_token_is_reported(compiler, tokenizer) -> None:
    matcher = compiler.compile(Choice(("yes",)), "f").new_matcher()
    assert not matcher.accept_token(tokenizer.encode("no", add_special_tokens=False)[0])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (JsonSchema({"type": "objekt"}), "objekt"),
        (JsonSchema({"type": "string", "format": "no-such-format"}, strict=True), "format"),
        (JsonSchema(["not", "a", "schema"]), "schema"),
        (Regex("a(b"), "regex"),
        (Choice(()), "at least one"),
        (Grammar("start: ("), "Expected"),
        (ForcedToolCalls("xml", (WEATHER,)), "markup"),
    ],
)
def test_invalid_constraints_name_the_field(compiler, spec, message) -> None:
    with pytest.raises(GrammarError, match=message) as error:
        compiler.compile(spec, "response_format.json_schema.schema")
    assert error.value.field == "response_format.json_schema.schema"
    assert str(error.value).startswith("response_format.json_schema.schema: ")


def test_three_samples_think_within_the_budget_then_write_valid_json(compiler, tokenizer, walk_weights) -> None:
    """n = 3 sequences of one compiled grammar, masks filled as one batch: 5 reasoning tokens,
    the forced end of the block, then JSON that validates."""
    newline = tokenizer.encode("\n", add_special_tokens=False)
    blank_line = tokenizer.encode("\n\n", add_special_tokens=False)
    markers = ReasoningMarkers(3, 4, (*newline, 4, *blank_line))  # SmolLM2 has no <think>: stand-in ids
    grammar = compiler.compile(JsonSchema(PERSON), "response_format")
    constraints: list[TokenConstraint | None] = [
        TokenConstraint(grammar.new_matcher(), markers, starts_in_reasoning=True, thinking_budget=5) for _ in range(3)
    ]
    outputs: list[list[int]] = [[], [], []]
    bitmask = np.zeros((3, (compiler.vocab_size + 31) // 32), dtype=np.int32)
    rng = np.random.default_rng(4)
    for _ in range(600):
        if not any(constraints):
            break
        fill_batch_bitmask(constraints, bitmask, compiler)
        for row, constraint in enumerate(constraints):
            if constraint is None:
                continue
            if constraint.in_reasoning and constraint.next_token_rule() is None:
                token_id = int(rng.integers(1000, 2000))  # free thinking: ordinary words
            else:
                allowed = allowed_ids(bitmask[row], compiler.vocab_size)
                token_id = int(rng.choice(allowed, p=walk_weights[allowed] / walk_weights[allowed].sum()))
            if token_id in tokenizer.eos_token_ids:
                constraints[row] = None
                continue
            constraint.accept(token_id)
            outputs[row].append(token_id)
    assert not any(constraints), "every sample ended"
    forced = list(markers.forced_end_token_ids)
    for token_ids in outputs:
        assert token_ids[5 : 5 + len(forced)] == forced
        answer = json.loads(tokenizer.decode(token_ids[5 + len(forced) :]))
        assert schema_errors(answer, PERSON) == []
    assert len({tuple(token_ids) for token_ids in outputs}) == 3


def test_a_mask_of_the_wrong_width_is_refused(compiler) -> None:
    matcher = compiler.compile(JsonObject(), "response_format").new_matcher()
    with pytest.raises(ValueError, match=r"bitmask_row: expected C-contiguous int32 \[1536\]"):
        matcher.fill_bitmask(np.zeros(1535, dtype=np.int32))
    with pytest.raises(ValueError, match="bitmask"):
        compiler.fill_bitmasks([(matcher, 0)], np.zeros((1, 1535), dtype=np.int32))


def test_matchers_of_one_grammar_are_independent_copies(compiler, tokenizer) -> None:
    """new_matcher copies the grammar's first matcher: advancing one leaves the next ones at the start."""
    grammar = compiler.compile(Choice(("alpha", "beta")), "structured_outputs.choice")
    width = (tokenizer.vocab_size + 31) // 32
    first, advanced = grammar.new_matcher(), grammar.new_matcher()
    start = np.zeros(width, np.int32)
    first.fill_bitmask(start)
    assert advanced.accept_token(tokenizer.encode("alpha", add_special_tokens=False)[0])
    later, mask = grammar.new_matcher(), np.zeros(width, np.int32)
    later.fill_bitmask(mask)
    np.testing.assert_array_equal(mask, start)
    advanced.fill_bitmask(mask)
    assert not np.array_equal(mask, start)


BOUNDED = {"type": "array", "minItems": 2, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 6, "minLength": 2},
                                     "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}}


def test_a_bounded_string_schema_carries_a_cheaper_superset_kept_in_step(compiler, tokenizer) -> None:
    """The superset (the schema without maxLength / minLength) allows every token the schema
    allows at each position of a walk, and more inside a name; `allows` tells which; rollback
    and fork keep the superset at the same position."""
    matcher = compiler.compile(JsonSchema(BOUNDED), "response_format").new_matcher()
    assert matcher.superset is not None
    unbounded = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    assert compiler.compile(JsonSchema(unbounded), "response_format").new_matcher().superset is None
    width = (compiler.vocab_size + 31) // 32
    exact, loose = np.zeros(width, dtype=np.int32), np.zeros(width, dtype=np.int32)
    text = '[{"name": "Annie", "age": 31}, {"name": "Bo", "age": 7}]'
    looser_somewhere = False
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        matcher.fill_bitmask(exact)
        matcher.superset.fill_bitmask(loose)
        allowed, superset = set(allowed_ids(exact, compiler.vocab_size)), set(allowed_ids(loose, compiler.vocab_size))
        assert allowed <= superset
        looser_somewhere |= allowed < superset
        refused = next(iter(superset - allowed), None)
        assert matcher.allows(token_id) and (refused is None or not matcher.allows(refused))
        assert matcher.accept_token(token_id)
    assert looser_somewhere
    fork = matcher.fork()
    matcher.rollback(3)
    for candidate in (fork, matcher):
        candidate.fill_bitmask(exact)
        candidate.superset.fill_bitmask(loose)
        assert set(allowed_ids(exact, compiler.vocab_size)) <= set(allowed_ids(loose, compiler.vocab_size))


def test_a_name_past_its_max_length_is_refused_by_the_schema_not_by_its_superset(compiler, tokenizer) -> None:
    matcher = compiler.compile(JsonSchema(BOUNDED), "response_format").new_matcher()
    for token_id in tokenizer.encode('[{"name": "Annie', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    long_tail = tokenizer.encode("Annie Smith", add_special_tokens=False)[-1]  # " Smith": 11 characters in all
    assert matcher.superset.allows(long_tail) and not matcher.allows(long_tail)
    assert matcher.accept_token(tokenizer.encode('"', add_special_tokens=False)[0])


def test_try_accept_refuses_without_breaking_and_accepts_as_accept_token_does(compiler, tokenizer) -> None:
    """`try_accept_token` is `allows` then `accept_token` in one call: a token past the name's
    bound is refused and the matcher (and its superset) stay usable where they were; an allowed
    token moves both as `accept_token` does, so the two matchers' masks agree after each."""
    tried, accepted = (compiler.compile(JsonSchema(BOUNDED), "response_format").new_matcher() for _ in range(2))
    long_tail = tokenizer.encode("Annie Smith", add_special_tokens=False)[-1]  # " Smith": 11 characters in all
    width = (compiler.vocab_size + 31) // 32
    tokens = tokenizer.encode('[{"name": "Annie", "age": 31}, {"name": "Bo", "age": 7}]', add_special_tokens=False)
    refused = False
    for index, token_id in enumerate(tokens):
        assert tried.try_accept_token(token_id) and accepted.accept_token(token_id)
        rows = np.zeros((4, width), dtype=np.int32)
        for row, matcher in enumerate((tried, accepted, tried.superset, accepted.superset)):
            matcher.fill_bitmask(rows[row])
        assert (rows[0] == rows[1]).all() and (rows[2] == rows[3]).all()
        if tokenizer.decode(list(tokens[: index + 1])).endswith("Annie"):
            assert not tried.try_accept_token(long_tail) and not tried.is_finished
            refused = True
    assert refused and tried.is_accepting


# A pattern intersected with a huge length bound: llguidance compiles it, then its lexer runs out
# of expressions when the string opens (once the first mask has been computed).
TOO_MUCH = JsonSchema({"type": "string", "pattern": "^(a+)+$", "minLength": 100_000})


def test_a_grammar_llguidance_gives_up_on_raises_where_a_refusal_returns_false(compiler, tokenizer) -> None:
    width = (compiler.vocab_size + 31) // 32
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    for accept in ("try_accept_token", "accept_token"):
        matcher = compiler.compile(TOO_MUCH, "response_format").new_matcher()
        row = np.zeros(width, dtype=np.int32)
        matcher.fill_bitmask(row)
        assert row[quote >> 5] >> (quote & 31) & 1  # the mask allowed the opening quote
        with pytest.raises(GrammarLimitError, match="too many expressions"):
            getattr(matcher, accept)(quote)
    # a plain refusal is False, not an error, and leaves the matcher usable
    no, yes = (tokenizer.encode(text, add_special_tokens=False)[0] for text in ("no", "yes"))
    choice = compiler.compile(Choice(("yes",)), "f").new_matcher()
    assert not choice.try_accept_token(no) and not choice.accept_token(no) and choice.accept_token(yes)


def test_end_of_sequence_is_allowed_and_taken_back_where_the_grammar_may_end(compiler, tokenizer) -> None:
    """llguidance's validate and try-consume never take end-of-sequence, though its masks allow
    it once the grammar may end: `allows` and the accepts take it there (a loosely masked row
    that ends its document is not sampled again), refuse it before, and a rollback takes it
    back without undoing the token before it (llguidance records no end after a stop)."""
    eos = min(tokenizer.eos_token_ids)
    width = (compiler.vocab_size + 31) // 32
    constraint = TokenConstraint(compiler.compile(JsonSchema(BOUNDED), "response_format").new_matcher(),
                                 loose_masks=True)
    matcher = compiler.compile(JsonSchema(BOUNDED), "response_format").new_matcher()
    assert not matcher.allows(eos) and not matcher.try_accept_token(eos)
    document = tokenizer.encode('[{"name": "Ann", "age": 3}, {"name": "Bo", "age": 7}]', add_special_tokens=False)
    for token_id in document:
        assert constraint.accept_sampled(token_id) and matcher.accept_token(token_id)
    before = np.zeros(width, dtype=np.int32)
    matcher.fill_bitmask(before)
    assert matcher.allows(eos) and constraint.admits(eos)
    assert constraint.accept_sampled(eos) and matcher.try_accept_token(eos) and matcher.is_finished
    space = tokenizer.encode(" ", add_special_tokens=False)[0]  # JSON would take it after the document
    assert not matcher.allows(eos) and not matcher.try_accept_token(eos)  # nothing follows the end
    assert not matcher.try_accept_token(space) and not matcher.accept_token(space)
    matcher.rollback(1)
    constraint.rollback(1)  # a rejected draft's end-of-sequence comes back off, and only it
    after = np.zeros(width, dtype=np.int32)
    matcher.fill_bitmask(after)
    assert (after == before).all() and constraint.accept_sampled(eos) and matcher.accept_token(eos)
    choice = compiler.compile(Choice(("yes",)), "f").new_matcher()
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    assert choice.accept_token(yes) and choice.accept_token(eos) and choice.is_finished
    choice.rollback(1)
    assert choice.is_accepting and choice.accept_token(eos)  # the end once more, after its rollback
    choice.rollback(1)
    rows = np.zeros((1, width), dtype=np.int32)
    ended = choice.fork()
    assert ended.accept_token(eos)
    compiler.fill_bitmasks([(ended, 0)], rows)
    assert np.flatnonzero(rows[0]).size == 1 and rows[0][eos >> 5] == 1 << (eos & 31)


def test_a_constraint_whose_grammar_gives_up_raises_gave_up_and_takes_nothing_back(compiler, tokenizer) -> None:
    """TokenConstraint turns GrammarLimitError into GrammarGaveUp (a ConstraintViolation the
    engine reports as the request's error); a rollback then leaves the dead matcher alone, and
    a draft round over it marks the row's later drafts unreachable instead of raising."""
    width = (compiler.vocab_size + 31) // 32
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    constraint = TokenConstraint(compiler.compile(TOO_MUCH, "response_format").new_matcher())
    row = np.zeros(width, dtype=np.int32)
    assert constraint.mask_for_next(row)
    with pytest.raises(GrammarGaveUp, match="too many expressions"):
        constraint.accept_sampled(quote)
    with pytest.raises(GrammarGaveUp):
        constraint.accept(quote)
    constraint.rollback(0)
    fresh = TokenConstraint(compiler.compile(TOO_MUCH, "response_format").new_matcher())
    masks = np.zeros((3, width), dtype=np.int32)
    assert fill_step_bitmask([(fresh, (quote, quote))], masks, compiler)
    assert (masks[1:] == -1).all()  # after the draft it gave up on: all ones, nothing accepted
