"""Speculative decoding on the real SmolLM2 (mock backend): greedy output with the n-gram
proposer is identical to plain decoding on edit-and-repeat prompts, drafts are accepted, and
the `atlas bench` prompt set loads; the speculative bench runs on a tiny model.

Skipped unless SmolLM2 has been pulled (`atlas pull smollm2`).
"""

from __future__ import annotations

import json

import pytest
from helpers.checkpoints import smollm2_folder

from atlas.app.bench.speculative import load_prompts
from atlas.app.llm import LLM
from atlas.domain.requests import SamplingParams

FOLDER = smollm2_folder()
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def test_the_shipped_prompt_set_has_twenty_edit_and_repeat_prompts_and_a_bad_file_is_named(tmp_path):
    prompts = load_prompts(None)
    assert len(prompts) >= 20 and all(isinstance(p, str) and len(p) > 80 for p in prompts)
    bad = tmp_path / "prompts.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(ValueError, match="--prompts .*a JSON list of prompt strings"):
        load_prompts(str(bad))


@pytest.mark.skipif(FOLDER is None, reason="SmolLM2 is not pulled (atlas pull smollm2)")
@pytest.mark.e2e
@pytest.mark.slow
def test_the_speculative_bench_reports_both_runs_and_the_verify_step_cost(tmp_path):
    from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
    from atlas.app.cli import main

    model = write_tiny_model(tmp_path / "tiny", shape=TinyModelShape(num_layers=1))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["a b c a b c a b c a b c", "one two one two one two", "x y z x y z x"]))
    report_path = tmp_path / "bench.json"
    code = main(["bench", "engine", str(model), "--device", "mock", "--batch-sizes", "1,2", "--decode-tokens", "12",
                 "--prompts", str(prompts), "--kv-cache-gb", "0.01", "--json", str(report_path),
                 "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1})])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert [row["batch"] for row in report["speculative"]] == [1, 2]
    for row in report["speculative"]:
        assert row["identical_outputs"] and row["prompts"] == 3 and row["plain_tokens_per_s"] > 0
        assert len(row["speedups"]) == row["rounds"] == 3 and row["speedup"] == sorted(row["speedups"])[1]
        # every token came from a verify step (accepted drafts + 1 each) or a step without drafts
        accepted = sum(row["accepted_by_position"])
        assert row["verify_steps"] > 0 and 0 <= row["undrafted_tokens"] < row["output_tokens"]
        assert row["undrafted_tokens"] + accepted + row["verify_steps"] == row["output_tokens"]
    assert report["verify_step_ms"] > 0 and report["decode_step_ms"] > 0


def test_greedy_smollm2_is_identical_with_and_without_the_ngram_proposer():
    prompts = load_prompts(None)
    conversations = [[{"role": "user", "content": prompts[i]}] for i in (0, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    speculative = LLM(str(FOLDER), device="mock", show_progress=False, max_seq_len=1024, speculative_config=NGRAM)
    with_drafts = [r.outputs[0].token_ids for r in speculative.chat(conversations, params)]
    plain = LLM(str(FOLDER), device="mock", show_progress=False, max_seq_len=1024)
    assert with_drafts == [r.outputs[0].token_ids for r in plain.chat(conversations, params)]
    stats = speculative.engine.core.stats()
    assert stats.num_spec_accepted_tokens > 0 and stats.num_spec_verify_steps > 0
    assert stats.num_blocks_free == stats.num_blocks_total


@pytest.mark.skipif(FOLDER is None, reason="SmolLM2 is not pulled (atlas pull smollm2)")
@pytest.mark.slow
def test_greedy_smollm2_drafting_for_itself_is_identical_and_accepts_every_draft():
    """SmolLM2 as its own draft model: the draft's greedy tokens are the target's, so every
    draft is accepted (but for a near-tie the two paths round differently) and nothing changes."""
    prompts = load_prompts(None)
    conversations = [[{"role": "user", "content": prompts[i]}] for i in (0, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    draft = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(FOLDER)}
    speculative = LLM(str(FOLDER), device="mock", show_progress=False, max_seq_len=1024, speculative_config=draft)
    with_drafts = [r.outputs[0].token_ids for r in speculative.chat(conversations, params)]
    plain = LLM(str(FOLDER), device="mock", show_progress=False, max_seq_len=1024)
    assert with_drafts == [r.outputs[0].token_ids for r in plain.chat(conversations, params)]
    stats = speculative.engine.core.stats()
    assert stats.num_spec_accepted_tokens >= 0.9 * stats.num_spec_draft_tokens > 0
    assert stats.num_blocks_free == stats.num_blocks_total
    proposer = speculative.engine.core.scheduler.speculation.proposer
    assert proposer.num_free_blocks == proposer.num_blocks
