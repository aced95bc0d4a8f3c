"""The random-weight benchmark models carry their families' real parameter counts and the names
their checkpoints use (so `atlas bench --random <family>` loads once the family loaders do)."""

from __future__ import annotations

import numpy as np
import pytest

from atlas.app.bench.random_model import CONFIGS, tensor_shapes


@pytest.mark.parametrize("name, billions", [("qwen3-30b-a3b", 30.53), ("qwen3-next-80b-a3b", 79.67),
                                            ("gemma-3-12b", 11.77), ("gpt-oss-20b", 20.91), ("llama-3.1-8b", 8.03)])
def test_a_family_config_has_its_models_parameter_count(name, billions):
    total = sum(int(np.prod(shape)) for _, shape in tensor_shapes(CONFIGS[name]))
    assert total / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen3_next_alternates_three_linear_layers_with_one_gated_attention_layer():
    names = dict(tensor_shapes(CONFIGS["qwen3-next-20l"]))
    config = CONFIGS["qwen3-next-20l"]
    for layer in range(20):
        full = (layer + 1) % config["full_attention_interval"] == 0
        assert (f"model.layers.{layer}.self_attn.q_proj.weight" in names) == full
        assert (f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight" in names) == (not full)
    assert names["model.layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)  # q heads and their gates
    assert names["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert "model.layers.0.mlp.experts.511.down_proj.weight" in names


def test_gpt_oss_has_sinks_biases_and_fused_experts():
    names = dict(tensor_shapes(CONFIGS["gpt-oss-20b"]))
    assert names["model.layers.0.self_attn.sinks"] == (64,)
    assert names["model.layers.0.self_attn.q_proj.bias"] == (64 * 64,)
    assert names["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 2 * 2880)
