"""FP8 checkpoints as published: tiny ones written here in both layouts, read back through the
safetensors adapter, dequantized against a loop-by-loop reference; and the configs refused."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.weights.safetensors import SafetensorsWeights, read_header, write_safetensors
from atlas.domain.models.quantization_config import (
    ActivationScheme,
    CheckpointFormat,
    Fp8Layout,
    QuantizationError,
    check_quantization,
    read_quantization,
)
from atlas.domain.models.quantization_weights import (
    E4M3,
    QuantizedWeight,
    quantize_per_channel,
    read_fp8_weight,
    stack_rows,
    take_columns,
    take_rows,
)
from atlas.ports.weights import WeightError

BF16 = np.dtype(ml_dtypes.bfloat16)

# What llm-compressor writes for FP8_DYNAMIC (per-channel weights, dynamic per-token activations).
CT_CHANNEL = {
    "config_groups": {
        "group_0": {
            "input_activations": {
                "actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
                "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float",
            },
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True, "type": "float",
            },
        }
    },
    "format": "float-quantized",
    "global_compression_ratio": 1.24,
    "ignore": ["lm_head", "re:.*mlp\\.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip
# Per-tensor weights with static activation scales (llm-compressor's FP8 scheme).
CT_TENSOR = json.loads(json.dumps(CT_CHANNEL))
CT_TENSOR["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
CT_TENSOR["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
# Qwen3-FP8 / DeepSeek-V3.
FP8_BLOCK = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate"],
}  # fmt: skip
# AutoFP8 (per tensor, static activations).
AUTO_FP8 = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}


def random_fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Every finite E4M3 byte is fair game, subnormals and +-448 included (no NaN: 0x7F, 0xFF)."""
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    return raw.view(E4M3)


def reference_dequantize(data: np.ndarray, scale: np.ndarray, layout: str) -> np.ndarray:
    """Element by element, straight from the published definitions (float64, then float32)."""
    rows, columns = data.shape
    out = np.empty((rows, columns), dtype=np.float64)
    for i in range(rows):
        for j in range(columns):
            if layout == "tensor":
                s = scale.reshape(-1)[0]
            elif layout == "channel":
                s = scale.reshape(-1)[i]
            else:
                s = scale[i // 128, j // 128]
            out[i, j] = float(data[i, j]) * float(s)
    return out.astype(np.float32)


def write_checkpoint(folder: Path, quantization_config: dict, tensors: dict[str, np.ndarray]) -> SafetensorsWeights:
    folder.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "quantization_config": quantization_config}
    (folder / "config.json").write_text(json.dumps(config))
    write_safetensors(folder / "model.safetensors", tensors)
    return SafetensorsWeights(folder)


def test_safetensors_round_trips_e4m3_bytes_under_their_published_dtype_name(tmp_path: Path) -> None:
    data = random_fp8(np.random.default_rng(0), (5, 7))
    write_safetensors(tmp_path / "w.safetensors", {"w": data})
    entries, _ = read_header(tmp_path / "w.safetensors")
    assert entries["w"].dtype == E4M3
    raw_header = json.loads((tmp_path / "w.safetensors").read_bytes()[8:][: entries["w"].begin_bytes - 8])
    assert raw_header["w"]["dtype"] == "F8_E4M3"
    back = SafetensorsWeights(tmp_path).get("w")
    assert back.dtype == E4M3 and np.array_equal(back.view(np.uint8), data.view(np.uint8))


def test_compressed_tensors_per_channel_dequantizes_like_the_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    q = random_fp8(rng, (24, 16))
    q_scale = rng.uniform(1e-4, 1e-2, size=(24, 1)).astype(BF16)  # llm-compressor keeps the model's dtype
    weights = write_checkpoint(tmp_path / "ct", CT_CHANNEL, {
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.q_proj.weight_scale": q_scale,
        "model.layers.0.mlp.gate.weight": rng.normal(size=(4, 16)).astype(BF16),
        "lm_head.weight": rng.normal(size=(32, 16)).astype(BF16),
    })  # fmt: skip
    checkpoint = read_quantization(json.loads((tmp_path / "ct" / "config.json").read_text()))
    assert checkpoint is not None and checkpoint.layouts == {Fp8Layout.PER_CHANNEL}
    weight = read_fp8_weight(weights, "model.layers.0.self_attn.q_proj", checkpoint)
    assert weight is not None and weight.layout is Fp8Layout.PER_CHANNEL and weight.input_scale is None
    assert np.array_equal(weight.dequantize(), reference_dequantize(q, q_scale, "channel"))
    assert read_fp8_weight(weights, "model.layers.0.mlp.gate", checkpoint) is None  # ignored, stored bf16
    assert read_fp8_weight(weights, "lm_head", checkpoint) is None


def test_compressed_tensors_per_tensor_reads_the_static_input_scale(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    o = random_fp8(rng, (16, 24))
    weights = write_checkpoint(tmp_path / "ct", CT_TENSOR, {
        "model.layers.0.self_attn.o_proj.weight": o,
        "model.layers.0.self_attn.o_proj.weight_scale": np.float32([0.0123]),
        "model.layers.0.self_attn.o_proj.input_scale": np.float32([0.5]),
    })  # fmt: skip
    checkpoint = read_quantization({"quantization_config": CT_TENSOR})
    weight = read_fp8_weight(weights, "model.layers.0.self_attn.o_proj", checkpoint)
    assert weight.scales.shape == () and weight.input_scale == 0.5
    assert checkpoint.scheme_for("model.layers.0.self_attn.o_proj").activations is ActivationScheme.STATIC_PER_TENSOR
    assert np.array_equal(weight.dequantize(), reference_dequantize(o, np.float32([0.0123]), "tensor"))


def test_block_fp8_with_partial_tiles_and_moe_experts_dequantizes_like_the_reference(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    tensors = {"model.layers.0.mlp.gate.weight": rng.normal(size=(4, 200)).astype(BF16)}
    for expert in range(2):
        prefix = f"model.layers.0.mlp.experts.{expert}.down_proj"
        tensors[f"{prefix}.weight"] = random_fp8(rng, (300, 200))  # 3 x 2 tiles, the last ones partial
        tensors[f"{prefix}.weight_scale_inv"] = rng.uniform(1e-4, 1e-2, size=(3, 2)).astype(np.float32)
    weights = write_checkpoint(tmp_path / "fp8", FP8_BLOCK, tensors)
    checkpoint = read_quantization({"quantization_config": FP8_BLOCK})
    for expert in range(2):
        prefix = f"model.layers.0.mlp.experts.{expert}.down_proj"
        weight = read_fp8_weight(weights, prefix, checkpoint)
        assert weight.layout is Fp8Layout.BLOCK and weight.block_size == (128, 128)
        expected = reference_dequantize(tensors[f"{prefix}.weight"], tensors[f"{prefix}.weight_scale_inv"], "block")
        assert np.array_equal(weight.dequantize(), expected)
    assert read_fp8_weight(weights, "model.layers.0.mlp.gate", checkpoint) is None


def test_stacked_expert_tensors_keep_their_leading_dim() -> None:
    rng = np.random.default_rng(4)
    data = random_fp8(rng, (3, 130, 260))
    scales = rng.uniform(0.01, 1, size=(3, 2, 3)).astype(np.float32)
    stacked = QuantizedWeight(data, scales, Fp8Layout.BLOCK, (128, 128)).dequantize()
    for expert in range(3):
        single = QuantizedWeight(data[expert], scales[expert], Fp8Layout.BLOCK, (128, 128)).dequantize()
        assert np.array_equal(stacked[expert], single)


def test_auto_fp8_per_tensor_scalars(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    v = random_fp8(rng, (8, 8))
    weights = write_checkpoint(tmp_path / "auto", AUTO_FP8, {
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.v_proj.weight_scale": np.float32(0.25).reshape(()),
        "model.layers.0.self_attn.v_proj.input_scale": np.float32(2.0).reshape(()),
    })  # fmt: skip
    weight = read_fp8_weight(weights, "model.layers.0.self_attn.v_proj", read_quantization({"quantization_config": AUTO_FP8}))
    assert weight.input_scale == 2.0
    assert np.array_equal(weight.dequantize(), v.astype(np.float32) * np.float32(0.25))


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ({"m.weight": "fp8"}, "m.weight_scale_inv is missing"),
        ({"m.weight": "fp8", "m.weight_scale_inv": np.ones((2, 1), np.float32)}, "needs (1, 1)"),
        ({"m.weight": "fp8", "m.weight_scale_inv": np.full((1, 1), np.nan, np.float32)}, "finite"),
        ({"lm_head.weight": "fp8", "lm_head.weight_scale_inv": np.ones((1, 1), np.float32)}, "leaves lm_head unquantized"),
    ],
)
def test_inconsistent_fp8_tensors_name_the_tensor(tmp_path: Path, tensors: dict, fragment: str) -> None:
    tensors = {k: random_fp8(np.random.default_rng(6), (4, 4)) if isinstance(v, str) else v for k, v in tensors.items()}
    weights = write_checkpoint(tmp_path / "bad", FP8_BLOCK, tensors)
    module = next(iter(tensors)).removesuffix(".weight")
    with pytest.raises(WeightError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        read_fp8_weight(weights, module, read_quantization({"quantization_config": FP8_BLOCK}))


def test_a_static_scheme_without_its_input_scale_is_named(tmp_path: Path) -> None:
    weights = write_checkpoint(tmp_path / "static", AUTO_FP8, {
        "m.weight": random_fp8(np.random.default_rng(7), (4, 4)), "m.weight_scale": np.float32([1.0]),
    })  # fmt: skip
    with pytest.raises(WeightError, match="m.input_scale"):
        read_fp8_weight(weights, "m", read_quantization({"quantization_config": AUTO_FP8}))


def test_which_modules_are_quantized_follows_each_format() -> None:
    ct = dict(CT_CHANNEL, ignore=["lm_head", "re:.*mlp\\.gate$", "model.layers.1.self_attn"])
    ct["config_groups"] = {"g": dict(CT_CHANNEL["config_groups"]["group_0"], targets=["re:.*_proj$"])}
    checkpoint = read_quantization({"quantization_config": ct})
    assert checkpoint.scheme_for("model.layers.0.mlp.gate_proj") is not None
    assert checkpoint.scheme_for("model.layers.0.mlp.gate") is None  # ignored by regex
    assert checkpoint.scheme_for("model.layers.1.self_attn.q_proj") is None  # an ignored ancestor
    assert checkpoint.scheme_for("lm_head") is None
    assert checkpoint.scheme_for("model.layers.0.mlp.router") is None  # not targeted
    fp8 = read_quantization({"quantization_config": FP8_BLOCK})
    assert fp8.scheme_for("model.layers.0.mlp.gate") is None
    assert fp8.scheme_for("model.layers.0.mlp.gate_proj") is not None  # "mlp.gate" stops at a boundary
    assert fp8.scheme_for("model.layers.10.mlp.gate") is not None
    assert read_quantization({"quantization_config": dict(FP8_BLOCK, modules_to_not_convert=["gate"])}).scheme_for(
        "model.layers.3.mlp.gate"
    ) is None  # a suffix


def refusal(quantization_config: object) -> str:
    with pytest.raises(QuantizationError) as caught:
        read_quantization({"quantization_config": quantization_config})
    message = str(caught.value)
    assert message.startswith("config.json quantization_config: ") and "\n" not in message
    assert "Atlas loads compressed-tensors float-quantized" in message and "quant_method fp8" in message
    return message


def ct_with(weights: dict | None = None, activations: dict | None | str = "keep", **top: object) -> dict:
    config = json.loads(json.dumps(CT_CHANNEL))
    group = config["config_groups"]["group_0"]
    group["weights"].update(weights or {})
    if activations != "keep":
        group["input_activations"] = activations
    config.update(top)
    return config


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "awq", "bits": 4}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
        ({"bits": 4}, "quant_method None"),
        ("fp8", "must be an object"),
        (ct_with(format="pack-quantized"), "'pack-quantized'"),
        (ct_with(format="nvfp4-pack-quantized"), "'nvfp4-pack-quantized'"),
        (ct_with({"type": "int"}), "8-bit int"),
        (ct_with({"num_bits": 4}), "4-bit float"),
        (ct_with({"strategy": "group", "group_size": 128}), "strategy 'group'"),
        (ct_with({"strategy": "block", "block_structure": [64, 64]}), "[64, 64]"),
        (ct_with({"symmetric": False}), "asymmetric"),
        (ct_with({"dynamic": True}), "dynamic"),
        (ct_with(activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "8-bit int"),
        (ct_with(activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}), "'token'"),
        (ct_with(quantization_status="frozen"), "'frozen'"),
        (ct_with(kv_cache_scheme={"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}), "kv_cache"),
        (ct_with(transform_config={"hadamard": {}}), "transform_config"),
        (ct_with(config_groups={}), "config_groups"),
        (dict(FP8_BLOCK, fmt="e5m2"), "'e5m2'"),
        (dict(FP8_BLOCK, weight_block_size=[64, 64]), "[64, 64]"),
        (dict(FP8_BLOCK, activation_scheme="static"), "static with weight_block_size"),
        (dict(FP8_BLOCK, scale_fmt="ue8m0"), "'ue8m0'"),
        (dict(FP8_BLOCK, expert_dtype="fp4"), "'fp4'"),
        (dict(FP8_BLOCK, modules_to_convert=["model.embed_tokens"]), "modules_to_convert"),
        (dict(FP8_BLOCK, modules_to_not_convert=["lm_head("]), "'lm_head(' is not a valid regex"),
        (ct_with(ignore=["re:model.(layers"]), "'model.(layers' is not a valid regex"),
    ],
)  # fmt: skip
def test_what_atlas_cannot_load_is_refused_by_name(config: object, named: str) -> None:
    assert named in refusal(config)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        (dict(FP8_BLOCK, weight_block_size=128), "weight_block_size 128 is not [128, 128]"),
        (ct_with({"strategy": "block", "block_structure": "128x128"}), "block_structure '128x128'"),
        (dict(FP8_BLOCK, modules_to_not_convert="lm_head"), "modules_to_not_convert must be a list"),
        (dict(FP8_BLOCK, modules_to_not_convert=None, ignored_layers=[["lm_head"]]), "ignored_layers must be a list"),
        (ct_with(ignore="lm_head"), "ignore must be a list"),
    ],
)  # fmt: skip
def test_a_malformed_value_is_refused_naming_its_key_not_read_a_character_at_a_time(config, named) -> None:
    with pytest.raises(QuantizationError, match=re.escape(named)) as caught:
        read_quantization({"quantization_config": config})
    assert str(caught.value).startswith("config.json quantization_config: ") and "\n" not in str(caught.value)


def test_a_group_targeting_another_class_is_refused() -> None:
    config = ct_with()
    config["config_groups"]["group_0"]["targets"] = ["Linear", "Embedding"]
    assert "'Embedding'" in refusal(config)


def test_every_published_variant_is_accepted_with_its_activation_scheme() -> None:
    cases = {
        ActivationScheme.DYNAMIC_PER_TOKEN: ct_with(),
        ActivationScheme.NONE: ct_with(activations=None),
        ActivationScheme.DYNAMIC_PER_GROUP: ct_with(
            {"strategy": "block", "block_structure": [128, 128]},
            {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True},
        ),
        ActivationScheme.STATIC_PER_TENSOR: CT_TENSOR,
    }
    for activations, config in cases.items():
        checkpoint = read_quantization({"quantization_config": config})
        assert checkpoint.scheme_for("model.layers.0.self_attn.q_proj").activations is activations
    ct_kv = ct_with(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False})
    assert read_quantization({"quantization_config": ct_kv}) is not None
    assert read_quantization({"architectures": ["LlamaForCausalLM"]}) is None


def test_the_load_hook_refuses_recognised_layouts_the_loader_cannot_build() -> None:
    raw = {"quantization_config": FP8_BLOCK}
    with pytest.raises(QuantizationError, match="fp8 \\(block 128x128, activations dynamic per group of 128\\) is recognised"):
        check_quantization(raw, loadable=())
    with pytest.raises(QuantizationError, match="recognised"):
        check_quantization(raw, loadable=[Fp8Layout.PER_CHANNEL])
    assert check_quantization(raw, loadable=[Fp8Layout.BLOCK]).format is CheckpointFormat.FP8
    assert check_quantization({}, loadable=()) is None
    with pytest.raises(QuantizationError, match="'awq'"):
        check_quantization({"quantization_config": {"quant_method": "awq"}}, loadable=list(Fp8Layout))


# -- --quantization fp8: per-channel quantization of a bf16 weight ----------------------------


def test_per_channel_quantization_stays_within_half_an_e4m3_step() -> None:
    rng = np.random.default_rng(8)
    weight = (rng.standard_t(3, size=(64, 96)) * rng.uniform(1e-3, 1, size=(64, 1))).astype(BF16)
    quantized = quantize_per_channel(weight)
    values = weight.astype(np.float32)
    error = np.abs(quantized.dequantize() - values)
    bound = np.maximum(np.abs(values) / 16, quantized.scales[:, None] / 1024) * (1 + 1e-6)
    assert (error <= bound).all()
    assert error.max() > 0.5 * bound[error.argmax() // 96, error.argmax() % 96]  # the bound is nearly reached
    # Each row's largest magnitude lands on +-448 exactly: the full range is used, nothing saturates past it.
    assert np.array_equal(np.abs(quantized.data.astype(np.float32)).max(axis=1), np.full(64, 448.0, np.float32))


def test_per_channel_quantization_of_e4m3_grid_values_is_lossless_and_zero_rows_stay_zero() -> None:
    rng = np.random.default_rng(9)
    grid = random_fp8(rng, (6, 10)).astype(np.float32)
    grid[:, 0] = 448.0  # a power-of-two scale then divides exactly
    weight = grid * np.float32(2.0**-7)
    weight[3] = 0.0
    quantized = quantize_per_channel(weight)
    assert np.array_equal(quantized.dequantize(), weight)
    assert quantized.scales[3] == 1.0
    with pytest.raises(ValueError, match="finite"):
        quantize_per_channel(np.array([[1.0, np.inf]], np.float32))


def test_fusing_projections_is_exact_for_per_tensor_and_block_parts() -> None:
    rng = np.random.default_rng(10)
    parts = [QuantizedWeight(random_fp8(rng, (rows, 16)), np.float32(s), Fp8Layout.PER_TENSOR, input_scale=i)
             for rows, s, i in ((8, 0.5, 1.0), (4, 0.25, 3.0), (4, 2.0, 2.0))]  # fmt: skip
    fused = stack_rows(parts)
    assert fused.layout is Fp8Layout.PER_CHANNEL and fused.input_scale == 3.0
    assert np.array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))
    blocks = [QuantizedWeight(random_fp8(rng, (rows, 200)), rng.uniform(0.1, 1, size=(math.ceil(rows / 128), 2)).astype(np.float32),
                              Fp8Layout.BLOCK, (128, 128)) for rows in (256, 128, 70)]  # fmt: skip
    fused_blocks = stack_rows(blocks)
    assert fused_blocks.scales.shape == (4, 2)
    assert np.array_equal(fused_blocks.dequantize(), np.concatenate([b.dequantize() for b in blocks]))
    with pytest.raises(ValueError, match="multiple of 128"):
        stack_rows([blocks[2], blocks[0]])
    with pytest.raises(ValueError, match="mixes"):
        stack_rows([blocks[0], quantize_per_channel(np.ones((4, 200), np.float32))])
    with pytest.raises(ValueError, match="static and dynamic"):
        stack_rows([parts[0], quantize_per_channel(np.ones((4, 16), np.float32))])


def test_regrouping_rows_and_splitting_columns_carry_the_scales_exactly() -> None:
    """Qwen3-Next's per-head interleaving regrouped (`take_rows`) and its MTP fc split by
    columns (`take_columns`): exact with row scales, with block scales only in whole tiles."""
    rng = np.random.default_rng(11)
    per_tensor = QuantizedWeight(random_fp8(rng, (6, 16)), np.float32(0.5), Fp8Layout.PER_TENSOR)
    rows = np.array([3, 0, 5, 1, 4, 2])
    regrouped = take_rows(per_tensor, rows)
    assert regrouped.layout is Fp8Layout.PER_CHANNEL
    assert np.array_equal(regrouped.dequantize(), per_tensor.dequantize()[rows])
    blocks = QuantizedWeight(random_fp8(rng, (320, 300)), rng.uniform(0.1, 1, size=(3, 3)).astype(np.float32),
                             Fp8Layout.BLOCK, (128, 128))
    tiles = np.concatenate([np.arange(128, 256), np.arange(0, 128), np.arange(256, 320)])
    assert np.array_equal(take_rows(blocks, tiles).dequantize(), blocks.dequantize()[tiles])
    for cut in (np.roll(np.arange(320), 64), np.concatenate([np.arange(256, 320), np.arange(0, 256)])):
        with pytest.raises(ValueError, match="whole 128-row tile"):
            take_rows(blocks, cut)
    for start, stop in ((0, 128), (128, 300)):
        split = take_columns(blocks, start, stop)
        assert np.array_equal(split.dequantize(), blocks.dequantize()[:, start:stop])
    with pytest.raises(ValueError, match="whole 128-column tiles"):
        take_columns(blocks, 0, 150)
    channel = quantize_per_channel(rng.standard_normal((4, 32)).astype(np.float32))
    assert np.array_equal(take_columns(channel, 16, 32).dequantize(), channel.dequantize()[:, 16:])


def test_a_quantized_weight_checks_its_shapes() -> None:
    data = random_fp8(np.random.default_rng(11), (4, 4))
    with pytest.raises(ValueError, match="scales"):
        QuantizedWeight(data, np.ones(3, np.float32), Fp8Layout.PER_CHANNEL)
    with pytest.raises(ValueError, match="data"):
        QuantizedWeight(data.astype(np.float32), np.ones(4, np.float32), Fp8Layout.PER_CHANNEL)
    with pytest.raises(ValueError, match="block_size"):
        QuantizedWeight(data, np.ones((1, 1), np.float32), Fp8Layout.BLOCK)


# -- where the model loads -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from helpers.checkpoints import tiny_llama_gguf

    from atlas.adapters.weights.gguf_import import import_gguf

    root = tmp_path_factory.mktemp("tiny")
    tiny_llama_gguf(root / "tiny.gguf", np.random.default_rng(0))
    return import_gguf(root / "tiny.gguf", root / "model", progress=False)


@pytest.mark.parametrize(
    ("quantization_config", "flags", "named"),
    [({"quant_method": "awq", "bits": 4, "group_size": 128}, [], "quant_method 'awq' is not supported"),
     (FP8_BLOCK, ["--quantization", "fp8"], "quantized already (fp8); drop --quantization fp8")],
)  # fmt: skip
def test_the_cli_refuses_a_quantized_checkpoint_before_reading_weights(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], quantization_config: dict, flags: list[str],
    named: str,
) -> None:
    from atlas.app.cli import main

    model = tmp_path / "quantized"
    model.mkdir()
    for item in tiny_model.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization_config)))
    (model / "model.safetensors").write_bytes(b"\x00" * 16)  # would fail as corrupt if it were read first
    code = main(["generate", str(model), "--prompt", "x", "--device", "mock", *flags])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("atlas: error:")]
    assert len(lines) == 1 and named in lines[0], err


def test_moe_experts_reach_their_kind_as_one_stacked_linear_with_scales() -> None:
    """An MoE loader reads each expert like any projection and stacks them: [E, out, in] E4M3
    with [E, out] (or [E, row tiles, column tiles]) scales, the values each expert stands for."""
    from atlas.domain.models.quantization_weights import host_linear, stack_experts

    rng = np.random.default_rng(12)
    channel = [quantize_per_channel(rng.normal(size=(6, 8)).astype(np.float32)) for _ in range(3)]
    stacked = stack_experts([host_linear(w) for w in channel])
    assert stacked.weight.shape == (3, 6, 8) and stacked.scales.shape == (3, 6) and stacked.block_shape is None
    assert np.array_equal(stacked.values(), np.stack([w.dequantize() for w in channel]))
    blocks = [QuantizedWeight(random_fp8(rng, (130, 260)), rng.uniform(0.1, 1, (2, 3)).astype(np.float32),
                              Fp8Layout.BLOCK, (128, 128)) for _ in range(2)]  # fmt: skip
    stacked_blocks = stack_experts([host_linear(w) for w in blocks])
    assert stacked_blocks.scales.shape == (2, 2, 3) and stacked_blocks.block_shape == (128, 128)
    assert np.array_equal(stacked_blocks.values(), np.stack([w.dequantize() for w in blocks]))
    per_tensor = host_linear(QuantizedWeight(random_fp8(rng, (6, 8)), np.float32(0.5), Fp8Layout.PER_TENSOR))
    assert per_tensor.scales.shape == (6,) and np.all(per_tensor.scales == 0.5)
    with pytest.raises(ValueError, match="differ"):
        stack_experts([host_linear(channel[0]), host_linear(blocks[0])])
