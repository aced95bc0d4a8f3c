"""FP8 checkpoints made from float tensors, in each published layout, for model-level tests.

`quantize_checkpoint(tensors, layout)` returns the tensors as such a checkpoint stores them, the
`quantization_config` that describes them, and the dequantized float32 value of every quantized
weight (what a reference model is given, so it computes on exactly the values Atlas reads).
`linears` widens which Linear modules it quantizes (Qwen3-Next's DeltaNet projections) and `skip`
leaves some in float, listed in the config as each format lists them (a published Qwen3-Next-FP8
names every layer's router, shared_expert_gate and in_proj_ba in `modules_to_not_convert`).
"""

from __future__ import annotations

import re

import numpy as np

from atlas.domain.models.quantization_weights import E4M3, E4M3_MAX, quantize_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYOUTS = ("channel", "tensor", "block", "auto_fp8")

_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
CONFIGS = {
    # llm-compressor FP8_DYNAMIC: per-channel weights, dynamic per-token activations
    "channel": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": dict(_WEIGHTS, strategy="channel"),
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                  "strategy": "token"},
        }},
        "ignore": ["lm_head"],
    },
    # compressed-tensors per-tensor weights, weight-only
    "tensor": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["re:.*_proj$"], "weights": dict(_WEIGHTS, strategy="tensor")}},
        "ignore": ["lm_head"],
    },
    # Qwen3-FP8 / DeepSeek-V3
    "block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["lm_head"]},
    # AutoFP8: per tensor, static activation scales
    "auto_fp8": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
}  # fmt: skip


def _per_tensor(weight: np.ndarray) -> tuple[np.ndarray, np.float32]:
    amax = float(np.abs(weight).max())
    scale = np.float32(amax / E4M3_MAX if amax > 0 else 1.0)
    return np.clip(weight / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def _per_block(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows, columns = weight.shape
    tiles = np.zeros((-(-rows // 128), -(-columns // 128)), np.float32)
    data = np.zeros(weight.shape, E4M3)
    for i in range(tiles.shape[0]):
        for j in range(tiles.shape[1]):
            tile = weight[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            amax = float(np.abs(tile).max())
            tiles[i, j] = amax / E4M3_MAX if amax > 0 else 1.0
            data[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)] = np.clip(
                tile / tiles[i, j], -E4M3_MAX, E4M3_MAX
            ).astype(E4M3)
    return data, tiles


def _skipped(module: str, skip: tuple[str, ...]) -> bool:
    return any(module == suffix or module.endswith(f".{suffix}") for suffix in skip)


def _config(layout: str, skipped: list[str], skip: tuple[str, ...]) -> dict:
    """CONFIGS[layout] leaving the `skip` modules in float too: by name where the format lists
    names (as published), by a regex where it lists patterns (llm-compressor's recipes)."""
    config = CONFIGS[layout]
    if not skip:
        return config
    if config["quant_method"] == "fp8":
        key = "modules_to_not_convert" if "modules_to_not_convert" in config else "ignored_layers"
        return {**config, key: ["lm_head", *skipped]}
    return {**config, "ignore": ["lm_head", *(rf"re:.*\.{re.escape(suffix)}$" for suffix in skip)]}


def quantize_checkpoint(
    tensors: dict[str, np.ndarray], layout: str, linears: tuple[str, ...] = PROJECTIONS, skip: tuple[str, ...] = ()
) -> tuple[dict, dict, dict]:
    """(stored tensors, quantization_config, {weight name: dequantized float32}) for `layout`:
    the [out, in] weights of the modules named `linears` (the last part of their names) are FP8,
    but those ending in one of `skip` ("mlp.gate", "linear_attn.in_proj_ba") and, for the
    per-tensor layout whose config targets `*_proj`, those not so named."""
    stored, dequantized, skipped = {}, {}, []
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        if not (name.endswith(".weight") and np.ndim(value) == 2 and leaf in linears) or (
                layout == "tensor" and not leaf.endswith("_proj")):
            stored[name] = value
            continue
        if _skipped(module, skip):
            stored[name] = value
            skipped.append(module)
            continue
        weight = np.asarray(value, np.float32)
        if layout == "channel":
            quantized = quantize_per_channel(weight)
            data, scale = quantized.data, quantized.scales[:, None]
            values = data.astype(np.float32) * scale
            stored[f"{module}.weight_scale"] = scale
        elif layout in ("tensor", "auto_fp8"):
            data, scale = _per_tensor(weight)
            values = data.astype(np.float32) * scale
            stored[f"{module}.weight_scale"] = np.array([scale], np.float32)
            if layout == "auto_fp8":
                stored[f"{module}.input_scale"] = np.array(0.05, np.float32)
        else:
            data, tiles = _per_block(weight)
            values = data.astype(np.float32) * np.repeat(np.repeat(tiles, 128, 0), 128, 1)[: weight.shape[0], : weight.shape[1]]
            stored[f"{module}.weight_scale_inv"] = tiles
        stored[name] = data
        dequantized[name] = values.astype(np.float32)
    return stored, _config(layout, skipped, skip), dequantized


def split_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' fused in-memory experts (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows
    first; `mlp.experts.down_proj` [E, H, I]) as published checkpoints store them, one
    `mlp.experts.E.{gate,up,down}_proj.weight` each."""
    split = {}
    for name, value in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            split[name] = value
            continue
        for expert, matrix in enumerate(value):
            if leaf == "down_proj":
                split[f"{prefix}.{expert}.down_proj.weight"] = matrix
            else:
                half = matrix.shape[0] // 2
                split[f"{prefix}.{expert}.gate_proj.weight"] = matrix[:half]
                split[f"{prefix}.{expert}.up_proj.weight"] = matrix[half:]
    return split


def load_dequantized(model, dequantized: dict[str, np.ndarray]) -> None:
    """Put the dequantized weights into a transformers model (float32 parameters); split experts
    (`split_experts`) go back into the model's fused expert tensors."""
    import torch

    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, values in dequantized.items():
            module, _, expert_leaf = name.removesuffix(".weight").rpartition(".")
            experts, _, expert = module.rpartition(".")
            if name in parameters or not experts.endswith("mlp.experts"):
                parameters[name].copy_(torch.from_numpy(values))
            elif expert_leaf == "down_proj":
                parameters[f"{experts}.down_proj"][int(expert)].copy_(torch.from_numpy(values))
            else:
                rows = values.shape[0]
                start = 0 if expert_leaf == "gate_proj" else rows
                parameters[f"{experts}.gate_up_proj"][int(expert), start : start + rows].copy_(torch.from_numpy(values))
