"""A request's constraint as plain data: it crosses the process boundary as msgpack, and the
engine turns it into per-sequence token constraints, compiling each grammar once."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from atlas.adapters.grammar.llguidance import LlguidanceCompiler
from atlas.adapters.tokenizers.hf import HfTokenizer
from atlas.app.bench.tiny_model import write_tiny_model
from atlas.app.engine_actor import AddRequest
from atlas.app.engine_protocol import Commands, ToEngine
from atlas.domain.request_constraints import GrammarCache, token_constraint
from atlas.domain.requests import OutputConstraint, ReasoningMarkers, Request, SamplingParams
from atlas.domain.token_mask import allowed_bits, bitmask_width
from atlas.ports.grammar import Choice, ForcedToolCalls, FunctionTool, GrammarError, JsonSchema, Regex

MARKERS = ReasoningMarkers(5, 6, (7, 6, 7))
SPECS = [
    JsonSchema({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=True),
    Regex("[0-9]+"),
    Choice(("yes", "no")),
    ForcedToolCalls("hermes", (FunctionTool("f", {"type": "object"}, "does f"),), parallel=True),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(folder) -> HfTokenizer:
    return HfTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def compiler(folder, tokenizer) -> LlguidanceCompiler:
    return LlguidanceCompiler((folder / "tokenizer.json").read_text(), tokenizer.vocab_size,
                              sorted(tokenizer.eos_token_ids), tokenizer.token_id)


@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: type(spec).__name__)
def test_a_constrained_request_crosses_to_the_engine_process_unchanged(spec):
    constraint = OutputConstraint(spec, "response_format", MARKERS, starts_in_reasoning=True, thinking_budget=32)
    request = Request("r-1", (1, 2, 3), SamplingParams(max_tokens=5), 7, 0.0, priority=2, constraint=constraint)
    frame = msgspec.msgpack.encode(Commands([AddRequest(request)]))
    decoded = msgspec.msgpack.decode(frame, type=ToEngine)
    assert decoded.commands[0].request == request


def test_a_constraint_must_constrain_something_and_a_budget_needs_the_markers():
    with pytest.raises(ValueError, match="grammar or a thinking budget"):
        OutputConstraint()
    with pytest.raises(ValueError, match="reasoning markers"):
        OutputConstraint(thinking_budget=8)
    with pytest.raises(ValueError, match=">= 0"):
        OutputConstraint(reasoning=MARKERS, thinking_budget=-1)


class CountingCompiler:
    def __init__(self, compiler) -> None:
        self.compiler = compiler
        self.compiled: list = []

    def compile(self, spec, field):
        self.compiled.append(spec)
        return self.compiler.compile(spec, field)


def test_the_sequences_of_one_request_compile_its_grammar_once_and_get_their_own_matchers(compiler, tokenizer):
    counting = CountingCompiler(compiler)
    grammars = GrammarCache(counting, capacity=2)
    constraint = OutputConstraint(Choice(("yes", "no")), "structured_outputs.choice")
    first, second = (token_constraint(constraint, grammars) for _ in range(2))
    assert counting.compiled == [Choice(("yes", "no"))]
    [yes] = tokenizer.encode("yes", add_special_tokens=False)[:1]
    first.accept(yes)  # one sequence's progress leaves the other at the start
    row = np.zeros(bitmask_width(tokenizer.vocab_size), dtype=np.int32)
    assert second.mask_for_next(row)
    assert allowed_bits(row, tokenizer.vocab_size)[yes]
    for spec in (Regex("a+"), Regex("b+"), Choice(("yes", "no"))):  # capacity 2: the choice was dropped
        token_constraint(OutputConstraint(spec, "f"), grammars)
    assert counting.compiled == [Choice(("yes", "no")), Regex("a+"), Regex("b+"), Choice(("yes", "no"))]


def test_a_budget_alone_needs_no_compiler_and_a_grammar_without_one_is_named(compiler):
    budget_only = token_constraint(OutputConstraint(reasoning=MARKERS, starts_in_reasoning=True, thinking_budget=0),
                                   None)
    assert budget_only is not None and budget_only.in_reasoning
    assert token_constraint(None, None) is None
    with pytest.raises(ValueError, match="response_format"):
        token_constraint(OutputConstraint(Regex("a"), "response_format"), None)
    with pytest.raises(GrammarError) as raised:
        token_constraint(OutputConstraint(Regex("(("), "structured_outputs.regex"), GrammarCache(compiler))
    assert raised.value.field == "structured_outputs.regex"
