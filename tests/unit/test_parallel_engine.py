"""A model on rank processes of the mock: the engine core drives 2 ranks that generate what one
device does; sizes that do not split and a rank that cannot load are refused at start with
their fix; a rank that dies stops the engine process, which names it; nothing is left behind."""

from __future__ import annotations

import json
import os
import re
import signal

import anyio
import pytest

from atlas.app.bench.tiny_model import TinyModelShape, write_tiny_model
from atlas.app.builder import build_engine
from atlas.app.engine_process import EngineProcess, EngineStopped
from atlas.app.llm import LLM
from atlas.app.settings import EngineSettings, SettingsError
from atlas.domain.requests import OutputConstraint, Request, SamplingParams
from atlas.ports.grammar import Regex
from helpers.processes import all_gone, rank_pids


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", shape=TinyModelShape(num_layers=1))


def settings(model, **changes) -> EngineSettings:
    base = dict(device="mock", max_seq_len=128, kv_cache_gb=0.01, block_size=8, max_num_seqs=8)
    return EngineSettings(str(model), **{**base, **changes})


def test_two_ranks_generate_what_one_device_does_and_closing_leaves_no_rank(model):
    """With n-gram drafts and a grammar too: the driver's core verifies the drafts and fills the
    masks, every rank samples under them (`SampleStep`)."""
    prompts = ["The capital of France", "Numbers such as 1, 2"]
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    one = LLM.from_settings(settings(model, speculative_config=ngram), show_progress=False)
    two = LLM.from_settings(settings(model, tensor_parallel_size=2, speculative_config=ngram), show_progress=False)
    pids = rank_pids()
    assert len(pids) == 2
    grammar = OutputConstraint(Regex("(ab|cd)+ [0-9]{3}"), "structured_outputs.regex")
    try:
        for params, constraint in ((SamplingParams(max_tokens=24, temperature=0.0), None),
                                   (SamplingParams(max_tokens=10, temperature=0.9, seed=7), None),
                                   (SamplingParams(max_tokens=24, temperature=0.9, seed=8), grammar)):
            expected = [output.outputs[0] for output in one.generate(prompts, params, constraint=constraint)]
            got = [output.outputs[0] for output in two.generate(prompts, params, constraint=constraint)]
            assert [output.token_ids for output in got] == [output.token_ids for output in expected]
        assert all(re.fullmatch("(ab|cd)+ [0-9]{3}", output.text) for output in got)
        stats = two.engine.core.stats()
        assert stats.num_spec_verify_steps > 0 and stats.num_blocks_free == stats.num_blocks_total
    finally:
        two.close()
    assert all_gone(pids)


def test_a_size_that_does_not_divide_is_refused_naming_the_flag_and_the_sizes_that_fit(model):
    with pytest.raises(SettingsError) as refusal:
        build_engine(settings(model, tensor_parallel_size=3))
    message = str(refusal.value)
    assert message.startswith("--tensor-parallel-size 3: tensor-parallel size 3 does not divide this model")
    assert "4 attention heads do not split into 3" in message
    assert message.endswith("Tensor-parallel sizes that fit (up to 8): 1, 2, 4")
    with pytest.raises(SettingsError, match="--tensor-parallel-size 2: expert-parallel size 2 .* has no experts"):
        build_engine(settings(model, tensor_parallel_size=2, enable_expert_parallel=True))
    with pytest.raises(SettingsError, match="give --tensor-parallel-size 2 or more"):
        settings(model, enable_expert_parallel=True)
    assert not rank_pids()


def test_a_rank_that_cannot_hold_a_sequence_refuses_the_start_with_the_fix(model):
    with pytest.raises(ValueError, match=r"rank \d: the KV cache can hold .* set --max-seq-len"):
        build_engine(settings(model, tensor_parallel_size=2, kv_cache_gb=0.0001, max_seq_len=4096))
    assert all_gone(rank_pids())


@pytest.mark.anyio
async def test_a_rank_killed_while_idle_stops_the_engine_process_naming_it(model):
    engine = EngineProcess(settings(model, tensor_parallel_size=2))
    await engine.start()
    pids = rank_pids(engine._process.pid)
    assert len(pids) == 2
    stopped: list[EngineStopped] = []
    try:
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run)
            stream = engine.submit([Request("a", (10, 20, 30), SamplingParams(max_tokens=4), seed=0)])
            async for _ in stream:
                pass
            os.kill(pids[1], signal.SIGKILL)
            with anyio.fail_after(30):
                await anyio.sleep_forever()
    except* EngineStopped as failures:
        stopped.extend(failures.exceptions)
    assert [str(error) for error in stopped] == ["rank 1 was killed by SIGKILL"]
    health = engine.health()
    assert not health.is_healthy and health.detail == "engine failed: rank 1 was killed by SIGKILL"
    assert engine._process.returncode is not None
    assert all_gone(pids)


def test_the_engine_bench_on_two_ranks_reports_each_ranks_roofline_and_its_collectives(model, tmp_path):
    from atlas.app.cli import main

    report_path = tmp_path / "bench.json"
    code = main(["bench", "engine", str(model), "--device", "mock", "--tensor-parallel-size", "2", "--batch-sizes",
                 "1,2", "--decode-tokens", "4", "--context", "16", "--kv-cache-gb", "0.01", "--json",
                 str(report_path)])
    assert code == 0
    report = json.loads(report_path.read_text())
    assert report["ranks"] == 2 and report["device"].startswith("2 ranks of numpy")
    config = json.loads((model / "config.json").read_text())
    one_device = LLM.from_settings(settings(model), show_progress=False).engine
    whole_bytes = 2 * one_device.config.num_parameters() - 2 * config["vocab_size"] * config["hidden_size"]
    assert report["weight_gb_per_step"] * 1e9 == pytest.approx(whole_bytes / 2, rel=1e-6)
    assert [row["batch"] for row in report["decode"]] == [1, 2]
    assert all(row["collective_ms"] > 0 and 0 < row["roofline_fraction"] for row in report["decode"])
    assert not rank_pids()
