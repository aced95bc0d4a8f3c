"""Structured output end to end on the real SmolLM2 (mock backend) with the llguidance compiler:
JSON-schema answers sampled at temperature 1 parse and validate, the n choices of a request
compile the grammar once (the engine's own compiler, built on first use) and each get their own
matcher, and a thinking budget on a reasoning template forces the end of the block before the
grammar starts.

Skipped unless SmolLM2 has been pulled (`atlas pull smollm2`).
"""

from __future__ import annotations

import json

import pytest
from helpers.checkpoints import smollm2_folder
from helpers.json_schema_check import schema_errors

from atlas.app.llm import LLM
from atlas.domain.requests import OutputConstraint, ReasoningMarkers, SamplingParams
from atlas.ports.grammar import JsonSchema

FOLDER = smollm2_folder()
pytestmark = [pytest.mark.skipif(FOLDER is None, reason="SmolLM2 is not pulled (atlas pull smollm2)"),
              pytest.mark.e2e, pytest.mark.slow]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a fictional person as JSON with a name, an age and a role."}]
# Two spare added tokens of SmolLM2's vocabulary stand for <think> and </think> (single tokens,
# never produced by the model on its own: the end can only come from the budget).
THINK, END_THINK, NEWLINE, BLANK_LINE = 15, 16, 198, 1116


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(FOLDER), device="mock", show_progress=False, max_seq_len=512, max_prefill_tokens=512, seed=11)


def test_json_schema_answers_sampled_at_temperature_one_parse_and_validate(llm):
    grammars = llm.engine.core.grammars
    compiled = []
    compile_once = grammars.compiler.compile
    grammars.compiler.compile = lambda spec, field: compiled.append(field) or compile_once(spec, field)
    resampled = llm.engine.core.num_resampled_tokens
    try:
        [result] = llm.chat(ASK, SamplingParams(temperature=1.0, max_tokens=80, n=8, seed=5),
                            constraint=OutputConstraint(JsonSchema(PERSON), "response_format"))
    finally:
        del grammars.compiler.compile
    assert compiled == ["response_format"]  # compiled once for the 8 choices
    # each document's end-of-sequence is accepted where it comes, not refused and drawn again
    assert llm.engine.core.num_resampled_tokens == resampled
    texts = [choice.text for choice in result.outputs]
    for choice in result.outputs:
        assert choice.finish_reason == "stop" and choice.error is None, choice
        assert schema_errors(json.loads(choice.text), PERSON) == [], choice.text
    assert len(set(texts)) > 1
    assert llm.engine.core.stats().num_blocks_free == llm.engine.core.stats().num_blocks_total


def test_a_thinking_budget_forces_the_end_of_the_block_before_the_grammar(llm):
    markers = ReasoningMarkers(THINK, END_THINK, (NEWLINE, END_THINK, BLANK_LINE))
    budget = 12
    constraint = OutputConstraint(JsonSchema(PERSON), "response_format", markers, starts_in_reasoning=True,
                                  thinking_budget=budget)
    prompt = llm.tokenizer.encode(llm.render_chat(ASK), add_special_tokens=False) + [THINK]
    [result] = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=100, n=2, seed=9),
                            constraint=constraint)
    for choice in result.outputs:
        tokens = choice.token_ids
        assert END_THINK not in tokens[:budget]
        assert tokens[budget : budget + 3] == [NEWLINE, END_THINK, BLANK_LINE]
        answer = llm.tokenizer.decode(tokens[budget + 3 :])
        assert choice.finish_reason == "stop" and schema_errors(json.loads(answer), PERSON) == [], answer


def test_the_bench_decodes_the_same_batch_under_the_schema_and_free(llm, tmp_path):
    from atlas.app.bench.structured import run_structured_bench

    schema = tmp_path / "records.schema.json"
    schema.write_text(json.dumps({"type": "array", "minItems": 50, "items": PERSON}))
    [row] = run_structured_bench(llm.engine, str(schema), [2], steps=3, rounds=2)["structured"]
    assert row["batch"] == 2 and row["json_schema_tokens_per_s"] > 0 and row["free_tokens_per_s"] > 0
    assert row["rounds"] == 2 and len(row["ratios"]) == 2 and min(row["ratios"]) <= row["ratio"] <= max(row["ratios"])
    assert row["json_schema_replaced"] == 0  # a 50-item array outlasts the window
    assert len(row["host_loop_ms"]) == 2 and all(ms > 0 for ms in row["host_loop_ms"])
    stats = llm.engine.core.stats()
    assert stats.num_running == 0
    assert stats.num_blocks_free == stats.num_blocks_total


def test_the_bench_stops_free_sequences_where_the_documents_ended(llm, tmp_path):
    """Short documents finish inside the window: the free loop's k-th sequence stops at the k-th
    document's length, so both loops replace (and prefill) as many sequences."""
    from atlas.app.bench.structured import json_schema_constraint, measure_closed_loop, schema_prompt

    schema = tmp_path / "flag.schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    engine = llm.engine
    constraint, prompt = json_schema_constraint(engine, str(schema)), schema_prompt(engine, str(schema))
    constrained = measure_closed_loop(engine, prompt, 2, 12, constraint, "json")
    free = measure_closed_loop(engine, prompt, 2, 12, None, "free", constrained.lengths)
    assert constrained.num_replaced >= 2 and abs(free.num_replaced - constrained.num_replaced) <= 1
    shared = constrained.lengths.keys() & free.lengths.keys()
    assert len(shared) >= 2 and all(free.lengths[k] == constrained.lengths[k] for k in shared)
    assert llm.engine.core.stats().num_running == 0
