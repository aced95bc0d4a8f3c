"""`atlas doctor` on CUDA: random-weight models of every family, written by transformers at head
sizes the CUDA kernels take, stay within three times transformers' own bf16 error at every layer.

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

_WIDE = dict(hidden_size=1024, intermediate_size=2816)
# Each family's tiny config (tests/tiny_models.py: its layer pattern, windows, caps, RoPE) at
# widths and head dims of the real models.
FAMILIES = {
    "llama3": dict(_WIDE, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=4),
    "qwen3": dict(_WIDE, num_attention_heads=16, num_key_value_heads=4, head_dim=64, num_hidden_layers=4),
    "qwen3_moe": dict(_WIDE, num_attention_heads=16, num_key_value_heads=4, head_dim=128, moe_intermediate_size=256),
    "gemma3": dict(_WIDE, num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256),
    "gpt_oss": dict(_WIDE, num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=256),
    "qwen3_next": dict(_WIDE, num_attention_heads=4, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4,
                       linear_num_value_heads=8, linear_key_head_dim=128, linear_value_head_dim=128,
                       moe_intermediate_size=256, shared_expert_intermediate_size=512),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_stays_within_three_times_transformers_bf16_noise(family, cuda_backend, tmp_path):
    write_model_folder(tmp_path, family, **FAMILIES[family])
    report = run_doctor(str(tmp_path), device="cuda")
    assert report.activation_dtype is DType.BF16 and report.reference is not None
    assert report.passed, report
