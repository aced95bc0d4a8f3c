"""benchmarks/serve_table.py: issue 29's serving bars from `atlas bench serve --json-file` runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_table.py"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("serve_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(out_tps: float, ttft_p50: float, hits_of_reusable: float | None = None, completed: int = 256) -> dict:
    return {"num_prompts": 256, "completed": completed, "output_tokens_per_s": out_tps, "ttft_p50_ms": ttft_p50,
            "ttft_p99_ms": 2 * ttft_p50, "tpot_p50_ms": 10.0, "tpot_p99_ms": 12.0, "prefix_cache_hits": 900.0,
            "reusable_tokens": 1000, "prefix_cache_hits_of_reusable": hits_of_reusable, "input_len": "16:900",
            "output_len": "16:256", "shared_prefix_len": 0, "num_turns": 1}


def write(folder: Path, **runs: dict) -> Path:
    for name, run in runs.items():
        (folder / f"{name.replace('_', '-')}.json").write_text(json.dumps({"summary": run, "requests": []}))
    return folder


def test_every_bar_is_its_ratio_and_the_exit_status_says_whether_all_hold(table, tmp_path, capsys):
    folder = write(tmp_path, mixed=summary(5500, 900), fixed=summary(6000, 300), prefix_on=summary(4000, 50),
                   prefix_off=summary(1900, 400), chat=summary(2000, 80, hits_of_reusable=0.95))
    bars = {bar: (value, holds) for bar, value, _, holds in table.bars(table.load(folder))}
    assert bars["mixed / fixed output tokens/s"] == (pytest.approx(5500 / 6000), True)
    assert bars["mixed output tokens/s"] == (5500, True)
    assert bars["prefix TTFT p50 on / off"] == (pytest.approx(0.125), True)
    assert bars["prefix output tokens/s on / off"] == (pytest.approx(4000 / 1900), True)
    assert bars["chat prefix hits / reusable"] == (0.95, True)
    assert table.main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert "900 / 1000" in out and "mixed 16:900/16:256" in out

    write(tmp_path, prefix_off=summary(2100, 400))  # output only 1.9x: that bar fails
    assert table.main([str(folder)]) == 1
    assert "FAILS" in capsys.readouterr().out


def test_a_missing_or_wholly_failed_run_leaves_its_bars_unmeasured(table, tmp_path, capsys):
    folder = write(tmp_path, mixed=summary(5400, 900), fixed=summary(0.0, 0.0, completed=0))
    bars = {bar: (value, holds) for bar, value, _, holds in table.bars(table.load(folder))}
    assert bars["mixed / fixed output tokens/s"] == (None, None)
    assert bars["mixed output tokens/s"] == (5400, True)
    assert bars["chat prefix hits / reusable"] == (None, None)
    assert table.main([str(folder)]) == 1
    out = capsys.readouterr().out
    assert "missing" in out and "not measured" in out
