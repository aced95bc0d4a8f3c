"""User mistakes reach the CLI as one line naming the fix, a non-zero exit and no traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from helpers.checkpoints import tiny_llama_gguf

from atlas.adapters.weights.gguf_import import import_gguf
from atlas.app.builder import _kv_dtype
from atlas.app.cli import main
from atlas.ports.gpu import DType


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(0))
    return import_gguf(root / "tiny.gguf", root / "model", progress=False)


def run_cli(capsys, *args):
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def error_line(err: str) -> str:
    """The error message (it may continue on indented lines), checked to be the only one."""
    starts = [i for i, line in enumerate(err.splitlines()) if line.startswith("atlas: error:")]
    assert len(starts) == 1, err
    assert "Traceback" not in err
    return "\n".join(err.splitlines()[starts[0]:])


def test_a_working_tiny_model_generates(tiny_model, capsys):
    code, out, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "hello", "--device", "mock",
                             "--max-tokens", "4")
    assert code == 0, err
    assert "--- prompt: 'hello'" in out


def test_missing_model_names_where_it_looked_and_the_fix(tmp_path, capsys):
    code, _, err = run_cli(capsys, "generate", str(tmp_path / "nope"), "--prompt", "x", "--device", "mock")
    assert code != 0
    line = error_line(err)
    assert "atlas pull" in line and "nope" in line


def test_truncated_safetensors_names_the_file(tiny_model, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_model.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run_cli(capsys, "generate", str(broken), "--prompt", "x", "--device", "mock")
    assert code != 0
    assert "model.safetensors" in error_line(err)


def test_corrupt_safetensors_header_names_the_file(tiny_model, tmp_path, capsys):
    broken = tmp_path / "corrupt"
    broken.mkdir()
    for item in tiny_model.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json!!!!"
    weights.write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "generate", str(broken), "--prompt", "x", "--device", "mock")
    assert code != 0
    assert "model.safetensors" in error_line(err)


def test_unsupported_architecture_lists_the_supported_ones(tiny_model, tmp_path, capsys):
    other = tmp_path / "gpt2"
    other.mkdir()
    for item in tiny_model.iterdir():
        (other / item.name).write_bytes(item.read_bytes())
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "generate", str(other), "--prompt", "x", "--device", "mock")
    assert code != 0
    line = error_line(err)
    assert "GPT2LMHeadModel" in line and "LlamaForCausalLM" in line and "Qwen3ForCausalLM" in line


@pytest.mark.parametrize(
    "flag, value, field",
    [("--temperature", "-1", "temperature"), ("--top-p", "1.5", "top_p"), ("--top-k", "-3", "top_k"),
     ("--min-p", "2", "min_p"), ("--max-tokens", "0", "max_tokens"), ("--repetition-penalty", "0", "repetition_penalty")],
)
def test_invalid_sampling_values_name_the_field(tiny_model, capsys, flag, value, field):
    code, _, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock", flag, value)
    assert code != 0
    assert error_line(err).startswith(f"atlas: error: {field}:")


def test_a_context_that_cannot_fit_says_what_would(tiny_model, capsys):
    code, _, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock",
                           "--max-seq-len", "100000", "--kv-cache-gb", "0.0001")
    assert code != 0
    line = error_line(err)
    assert "--max-seq-len" in line and "--kv-cache-gb" in line


def test_engine_flag_values_are_checked(tiny_model, capsys):
    code, _, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock",
                           "--gpu-memory-utilization", "1.5")
    assert code != 0
    assert "--gpu-memory-utilization" in error_line(err)


def test_the_admission_cap_is_checked_and_reaches_the_scheduler(tiny_model, capsys):
    code, _, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock",
                           "--max-admitted-tokens", "0")
    assert code != 0
    assert "--max-admitted-tokens must be at least 1 (got 0)" in error_line(err)

    from atlas.app.builder import build_engine
    from atlas.app.settings import EngineSettings

    for flag, expected in ((None, 2048 // 16), (48, 48)):
        settings = EngineSettings(model=str(tiny_model), device="mock", max_prefill_tokens=2048,
                                  max_admitted_tokens=flag)
        engine = build_engine(settings, show_progress=False)
        try:
            assert engine.core.scheduler.config.max_admitted_tokens == expected
        finally:
            engine.close()


def test_the_installed_command_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "atlas", "chat", str(tmp_path / "missing"), "--device", "mock", "-m", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "atlas: error: model" in result.stderr and "atlas pull smollm2" in result.stderr


def test_an_fp8_kv_cache_generates_on_the_mock(tiny_model, capsys):
    code, out, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "hello", "--device", "mock",
                             "--max-tokens", "4", "--kv-cache-dtype", "fp8")
    assert code == 0, err
    assert "--- prompt: 'hello'" in out


def test_a_kv_cache_dtype_the_backend_lacks_names_the_flag_and_the_choices():
    backend = SimpleNamespace(
        name="cuda", capabilities=SimpleNamespace(activation_dtype=DType.BF16, kv_dtypes=(DType.BF16,))
    )
    assert _kv_dtype("auto", backend) is DType.BF16
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 is not supported on cuda; use auto or one of bf16$"):
        _kv_dtype("fp8", backend)


def serve_errors(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([sys.executable, "-m", "atlas", "serve", *args], capture_output=True, text=True,
                            timeout=120, env={**os.environ, **(env or {})})
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_errors(str(tiny_model), "--device", "mock", "--port", str(port))
    assert "already in use" in line and f"--port {port}" in line


@pytest.mark.parametrize("args,env,named", [
    (["--port", "70000"], None, "--port"),
    (["--port", "eighty"], None, "--port"),
    (["--bind", "no-such-host.invalid"], None, "--bind"),
    (["--shutdown-timeout", "-1"], None, "--shutdown-timeout"),
    (["--max-choices-per-request", "0"], None, "--max-choices-per-request"),
    ([], {"ATLAS_PORT": "http"}, "ATLAS_PORT"),
    (["--max-seq-lenn", "5"], None, "--max-seq-len"),
])
def test_bad_serve_flags_are_one_line_naming_them(tiny_model, args, env, named):
    assert named in serve_errors(str(tiny_model), "--device", "mock", *args, env=env)


def test_the_priority_policy_and_no_prefix_caching_flags_reach_the_engine(tiny_model, capsys):
    code, out, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "hello", "--device", "mock",
                             "--max-tokens", "3", "--scheduling-policy", "priority", "--no-prefix-caching")
    assert code == 0, err
    assert "--- prompt: 'hello'" in out
    with pytest.raises(SystemExit):
        run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock",
                "--scheduling-policy", "lottery")
    assert "invalid choice: 'lottery' (choose from 'fifo', 'priority')" in capsys.readouterr().err


@pytest.mark.parametrize("config, expected", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 65}', "speculative_config.num_speculative_tokens"),
    ('{"method": "mtp", "num_speculative_tokens": 1}', "use ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "lookahead": 2}', "speculative_config.lookahead"),
])
def test_a_bad_speculative_config_is_one_line_naming_the_flag_and_key(tiny_model, capsys, config, expected):
    code, _, err = run_cli(capsys, "generate", str(tiny_model), "--prompt", "x", "--device", "mock",
                           "--speculative-config", config)
    line = error_line(err)
    assert code == 2 and line.startswith("atlas: error: --speculative-config:") and expected in line


def test_generate_with_ngram_speculation_prints_what_it_prints_without(tiny_model, capsys):
    args = ["generate", str(tiny_model), "--prompt", "a b a b a b a b", "--device", "mock", "--max-tokens", "16"]
    plain = run_cli(capsys, *args)
    speculative = run_cli(capsys, *args, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert plain[0] == speculative[0] == 0 and plain[1] == speculative[1]
