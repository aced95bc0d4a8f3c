"""`atlas doctor` on CUDA: a random-weight Llama of real head sizes, written by transformers,
stays within three times transformers' own bf16 error at every layer.

Run on a GPU machine: `python -m pytest tests/gpu/test_doctor_cuda.py -m gpu -s` (-s shows the
table).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_models import write_model_folder  # noqa: E402

from atlas.app.doctor import run_doctor  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_every_layer_stays_within_three_times_transformers_bf16_noise(family, cuda_backend, tmp_path):
    write_model_folder(tmp_path, family, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, intermediate_size=2816, num_hidden_layers=4)
    report = run_doctor(str(tmp_path), device="cuda")
    assert report.activation_dtype is DType.BF16 and report.reference is not None
    assert report.passed, report
