"""The new families' config.json as published: layer types, per-type RoPE (YaRN as transformers
computes it), MoE sizes, and the options Atlas refuses, each named."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import DictWeights

from atlas.adapters.mock.backend import MockGpuBackend
from atlas.domain.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig, ModelConfigError, Rope
from atlas.domain.models.families import load_model
from atlas.domain.models.quantization_config import QuantizationError, read_quantization
from atlas.domain.models.rope import inverse_frequencies, rope_table

GEMMA_3_1B = dict(
    architectures=["Gemma3ForCausalLM"], attention_bias=False, attn_logit_softcapping=None, bos_token_id=2,
    eos_token_id=[1, 106], final_logit_softcapping=None, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    hidden_size=1152, intermediate_size=6912, max_position_embeddings=32768, model_type="gemma3_text",
    num_attention_heads=4, num_hidden_layers=26, num_key_value_heads=1, query_pre_attn_scalar=256,
    rms_norm_eps=1e-6, rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000, sliding_window=512,
    sliding_window_pattern=6, vocab_size=262144,
)
GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, eos_token_id=200002, head_dim=64, hidden_act="silu",
    hidden_size=2880, intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, rms_norm_eps=1e-5,
    quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]),
    rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                      rope_type="yarn", truncate=False),
    rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False, vocab_size=201088,
)
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], attention_bias=False, decoder_sparse_step=1, head_dim=128,
    hidden_act="silu", hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960, mlp_only_layers=[],
    model_type="qwen3_moe", moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128,
    num_experts_per_tok=8, num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-6, rope_scaling=None,
    rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False, use_sliding_window=False,
    vocab_size=151936,
)  # fmt: skip


@pytest.mark.parametrize(
    "raw, billions",
    [(GEMMA_3_1B, 1.00), (GPT_OSS_20B, 20.91), (QWEN3_30B_A3B, 30.53)],
    ids=["gemma3", "gpt-oss", "qwen3-moe"],
)
def test_parameter_counts_are_the_published_ones(raw, billions):
    """The startup memory check counts every expert: the totals the model cards give."""
    assert ModelConfig.from_dict(raw).num_parameters() / 1e9 == pytest.approx(billions, rel=0.01)


def test_gemma3_layer_types_follow_the_pattern_each_type_with_its_rope():
    config = ModelConfig.from_dict(dict(GEMMA_3_1B, rope_scaling=dict(rope_type="linear", factor=8.0)))
    assert config.layer_types[:6] == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,)
    assert [config.layer_window(layer) for layer in (0, 4, 5, 11, 25)] == [512, 512, None, None, 512]
    assert config.layer_rope(0) == Rope(10000.0)  # the local base frequency, never scaled
    assert config.layer_rope(5).theta == 1e6 and config.layer_rope(5).scaling.factor == 8.0
    assert config.query_pre_attn_scalar == 256 and config.hidden_act == "gelu_pytorch_tanh"


def test_gpt_oss_reads_its_layer_types_yarn_and_experts():
    config = ModelConfig.from_dict(GPT_OSS_20B)
    assert [config.layer_window(layer) for layer in range(4)] == [128, None, 128, None]
    assert config.rope_scaling.kind == "yarn" and not config.rope_scaling.truncate
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert all(config.is_moe_layer(layer) for layer in range(24)) and config.attention_bias
    assert read_quantization(GPT_OSS_20B) is None  # dequantized by the loader


def test_qwen3_moe_dense_layers_follow_transformers_rule():
    config = ModelConfig.from_dict(dict(QWEN3_30B_A3B, num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2))
    assert [config.is_moe_layer(layer) for layer in range(6)] == [False, True, False, True, False, True]


def test_qwen2_biases_q_k_v_whatever_its_config_says():
    """transformers' Qwen2Attention builds q/k/v with bias=True and never reads attention_bias;
    a config.json that sets it false still ships (and needs) those biases."""
    qwen2 = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    assert ModelConfig.from_dict(dict(qwen2, attention_bias=False)).attention_bias
    assert ModelConfig.from_dict(qwen2).attention_bias
    assert not ModelConfig.from_dict(dict(qwen2, model_type="llama", architectures=["LlamaForCausalLM"])).attention_bias


def test_mxfp4_is_refused_for_an_architecture_whose_loader_does_not_dequantize_it():
    with pytest.raises(QuantizationError, match="mxfp4.*GptOssForCausalLM only, not Qwen3MoeForCausalLM"):
        read_quantization(dict(QWEN3_30B_A3B, quantization_config=dict(quant_method="mxfp4")))


@pytest.mark.parametrize(
    "raw, match",
    [
        (dict(GEMMA_3_1B, use_bidirectional_attention=True), "use_bidirectional_attention"),
        (dict(GEMMA_3_1B, attn_logit_softcapping=50.0), "attn_logit_softcapping"),
        (dict(GPT_OSS_20B, layer_types=["chunked_attention", "full_attention"] * 12), "chunked_attention layers"),
        (dict(GPT_OSS_20B, sliding_window=None), "sliding_window: .* no window"),
        (dict(QWEN3_30B_A3B, num_experts_per_tok=None), r"num_experts_per_tok: 0 must be in \[1, num_experts = 128\]"),
    ],
    ids=["bidirectional", "attention-softcap", "layer-type", "no-window", "top-k"],
)
def test_an_option_atlas_does_not_run_is_refused_before_any_weight_is_read(raw, match):
    two_layers = dict(raw, num_hidden_layers=2)
    if "layer_types" in raw:
        two_layers["layer_types"] = raw["layer_types"][:2]
    config = ModelConfig.from_dict(two_layers)
    with pytest.raises(ModelConfigError, match=match):
        load_model(config, DictWeights({}), MockGpuBackend(), 64)  # no tensors: reading one would fail


def test_a_sliding_rope_of_an_unsupported_kind_is_refused():
    raw = dict(GEMMA_3_1B, rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e6),
                                                 sliding_attention=dict(rope_type="dynamic", rope_theta=1e4)))
    with pytest.raises(ModelConfigError, match="'dynamic' is not supported"):
        ModelConfig.from_dict(raw)


def test_layer_types_must_cover_every_layer():
    with pytest.raises(ModelConfigError, match="layer_types has 24 entries for num_hidden_layers 2"):
        ModelConfig.from_dict(dict(GPT_OSS_20B, num_hidden_layers=2))


# -- RoPE against transformers' own tables ------------------------------------------------------

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _expected(inverse_frequencies, attention_scaling: float, positions: int) -> np.ndarray:
    inverse = inverse_frequencies.double().numpy()
    angles = np.arange(positions, dtype=np.float64)[:, None] * inverse[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * attention_scaling


def _assert_same_rope(config: ModelConfig, rope: Rope, inverse_reference, attention_scaling: float) -> None:
    """The inverse frequencies to float32 rounding (numpy's and torch's float32 powers may part
    by an ulp), the attention factor exactly, and the table they give."""
    inverse, factor = inverse_frequencies(rope, config.rotary_dim, config.max_position_embeddings)
    np.testing.assert_allclose(inverse, inverse_reference.numpy(), rtol=3e-7, atol=0)
    assert factor == pytest.approx(attention_scaling, rel=1e-12)
    expected = _expected(inverse_reference, attention_scaling, 64)
    np.testing.assert_allclose(rope_table(config, 64, rope), expected, atol=1e-5)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
             original_max_position_embeddings=4096),
        dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096),  # truncate defaults to true
        dict(rope_type="yarn", factor=4.0, mscale=0.707, mscale_all_dim=1.0, original_max_position_embeddings=2048),
        dict(rope_type="yarn", factor=None, original_max_position_embeddings=32768),  # factor from the contexts
        dict(rope_type="yarn", factor=8.0, attention_factor=1.25, original_max_position_embeddings=4096),
    ],
    ids=["gpt-oss", "truncated", "mscale", "no-factor", "attention-factor"],
)
def test_yarn_equals_transformers(rope_parameters):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    raw = dict(GPT_OSS_20B, rope_scaling=None, rope_parameters=dict(rope_parameters, rope_theta=150000.0))
    reference = GptOssRotaryEmbedding(GptOssConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    config = ModelConfig.from_dict(raw)
    _assert_same_rope(config, config.layer_rope(0), reference.inv_freq, reference.attention_scaling)


def test_gemma3_ropes_per_layer_type_equal_transformers():
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = dict(GEMMA_3_1B, rope_scaling=dict(rope_type="linear", factor=8.0))
    reference = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    config = ModelConfig.from_dict(raw)
    for layer, kind in ((0, "sliding_attention"), (5, "full_attention")):
        inverse, scaling = getattr(reference, f"{kind}_inv_freq"), getattr(reference, f"{kind}_attention_scaling")
        _assert_same_rope(config, config.layer_rope(layer), inverse, scaling)
