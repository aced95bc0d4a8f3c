"""`atlas doctor`: the first layer that leaves the noise is named and the command fails; without
transformers it still catches a layer gone non-finite; user mistakes are one line."""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import write_model_folder  # noqa: E402

from atlas.adapters.weights.safetensors import SafetensorsWeights, write_safetensors  # noqa: E402
from atlas.app.cli import main  # noqa: E402
from atlas.app.doctor import F32_BOUND, layer_bound, run_doctor  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402

pytestmark = pytest.mark.oracle
PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doctor") / "llama"
    write_model_folder(folder, "llama3", num_hidden_layers=3)
    return folder


def _copy_with(folder, target, change) -> None:
    """`folder` copied to `target` with its weights passed through `change(name, array)`."""
    shutil.copytree(folder, target)
    weights = SafetensorsWeights(folder)
    tensors = {name: change(name, np.array(weights.get(name))) for name in weights.names()}
    write_safetensors(target / "model.safetensors", tensors, {"format": "pt"})


def test_a_layer_that_computes_something_else_is_named_and_the_command_fails(folder, tmp_path, capsys):
    """The copy's layer 1 down projection is 2% off: layers 0 stays within the noise, layer 1
    is named, and `atlas doctor` exits 1."""
    broken = tmp_path / "broken"
    _copy_with(folder, broken, lambda name, w: w * 1.02 if name == "model.layers.1.mlp.down_proj.weight" else w)
    report = run_doctor(str(broken), device="mock", prompt=PROMPT, reference=str(folder), write=lambda line: None)
    assert report.first_bad_layer == 1 and not report.passed
    assert report.layers[0].error < 1e-5 < F32_BOUND < report.layers[1].error
    assert main(["doctor", str(broken), "--device", "mock", "--prompt", PROMPT, "--reference", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "FAIL: layer 1 (attention + dense) is the first to leave the noise against transformers" in out
    assert main(["doctor", str(folder), "--device", "mock", "--prompt", PROMPT]) == 0
    assert "ok: all 3 layers within their bounds" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_without_transformers_atlas_runs_alone_and_a_non_finite_layer_still_fails(folder, tmp_path, monkeypatch):
    broken = tmp_path / "inf"
    _copy_with(folder, broken, lambda name, w: w * np.inf if name == "model.layers.2.self_attn.o_proj.weight" else w)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    lines: list[str] = []
    report = run_doctor(str(broken), device="mock", prompt=PROMPT, write=lines.append)
    assert report.reference is None and report.first_bad_layer == 2
    assert any("transformers is not installed" in line for line in lines)
    assert lines[-1].startswith("FAIL: layer 2 (attention + dense)") and "not finite" in lines[-1]
    assert run_doctor(str(folder), device="mock", prompt=PROMPT, write=lines.append).passed


def test_an_unknown_architecture_is_one_line_naming_the_supported_ones(folder, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["FalconForCausalLM"]}))
    assert main(["doctor", str(other), "--device", "mock"]) == 2
    error = capsys.readouterr().err.strip()
    assert "architecture 'FalconForCausalLM' is not supported" in error and "Qwen3NextForCausalLM" in error
    assert len(error.splitlines()) == 1


def test_the_bound_is_three_times_transformers_bf16_noise_or_fixed_for_float32():
    assert layer_bound(0.02, DType.BF16) == pytest.approx(0.06)
    assert layer_bound(1e-5, DType.BF16) == 1e-3  # never below the floor
    assert layer_bound(0.02, DType.F32) == F32_BOUND


def test_a_transformers_that_hard_codes_gpt_oss_swiglu_limit_runs_the_configs(tmp_path, monkeypatch):
    """transformers before 5.19 builds GPT-OSS's experts with limit 7.0 whatever config.json says;
    against such a reference the tiny model's limit 1.0 (a clamp its experts reach) put layer 0
    ~60% off. The doctor gives the reference config.json's values, says so, and passes."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    write_model_folder(tmp_path, "gpt_oss")
    built = modeling_gpt_oss.GptOssExperts.__init__

    def as_before_5_19(self, config):
        built(self, config)
        self.alpha, self.limit = 1.702, 7.0

    monkeypatch.setattr(modeling_gpt_oss.GptOssExperts, "__init__", as_before_5_19)
    lines: list[str] = []
    report = run_doctor(str(tmp_path), device="mock", prompt=PROMPT, write=lines.append, show_progress=False)
    assert report.passed and report.reference is not None, lines
    assert max(check.error for check in report.layers) < 1e-5
    assert any("swiglu_limit 7 whatever config.json says" in line and "1.702 and 1" in line for line in lines)
