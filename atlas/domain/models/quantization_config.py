"""FP8 checkpoints: which `quantization_config` Atlas loads, and which modules it quantizes how.

Accepted (anything else is refused by `read_quantization` with a one-line `QuantizationError`):

  quant_method "compressed-tensors" (llm-compressor), format "float-quantized", every group with
    weights            8-bit float, symmetric, static; strategy tensor | channel | block [128, 128]
    input_activations  none, or 8-bit float symmetric: dynamic per token / tensor / group of 128,
                       or static per tensor (`input_scale`)
    tensors            <module>.weight E4M3 [out, in]; <module>.weight_scale f32/bf16/f16:
                       [] or [1] | [out, 1] | [ceil(out / 128), ceil(in / 128)]
    modules            matched by a group's `targets` ("Linear", an exact name, or "re:" + a regex
                       matched from the start), minus `ignore` (the same forms, or an ancestor)
  quant_method "fp8" (transformers' FineGrainedFP8: DeepSeek-V3, Qwen3-FP8; AutoFP8), fmt e4m3
    weight_block_size [128, 128]  -> <module>.weight_scale_inv [ceil(out / 128), ceil(in / 128)]
    no weight_block_size          -> per tensor <module>.weight_scale (or weight_scale_inv)
    activation_scheme dynamic, or static with per-tensor weights (`input_scale`)
    modules            every Linear but `modules_to_not_convert` / `ignored_layers` (transformers'
                       rule: a regex ending at a module boundary, or a suffix)
  quant_method "mxfp4" for GPT-OSS only, whose loader dequantizes the MXFP4 experts to bf16 at
    load (`mxfp4.py`); `read_quantization` returns None for it, the weights being float after.

MoE experts are Linear modules like any other (`...mlp.experts.7.gate_proj`), and stacked
expert tensors [E, out, in] carry scales with the same leading dim. Every scale multiplies,
whatever its name says: weight = float(e4m3 byte) * scale, each block scale covering its
128 x 128 tile (the last row / column of tiles may be partial):

    in ->   0 ........ 127 | 128 ...... 255 | 256 .. 299
    out 0   scale[0, 0]    | scale[0, 1]    | scale[0, 2]
    ..127                  |                |
    128 ..  scale[1, 0]    | scale[1, 1]    | scale[1, 2]

The activation scheme is advisory: kernels may keep activations in bf16 (more accurate). The
weights' host math (dequantizing, quantizing at load, fusing) is quantization_weights.py's.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from atlas.domain.models.config import ModelConfigError

BLOCK_SIZE = (128, 128)
SUPPORTED = (
    "compressed-tensors float-quantized (8-bit float weights per tensor, per channel or in 128x128 blocks) "
    "and quant_method fp8 (e4m3, per tensor or weight_block_size [128, 128]); mxfp4 for GPT-OSS"
)
MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)  # their loaders dequantize MXFP4 experts at load


class QuantizationError(ModelConfigError):
    """config.json's `quantization_config` asks for something Atlas cannot load."""

    def __init__(self, what: str, name_supported: bool = True) -> None:
        supported = f"; Atlas loads {SUPPORTED}" if name_supported else ""
        super().__init__(f"config.json quantization_config: {what}{supported}")


class CheckpointFormat(Enum):
    COMPRESSED_TENSORS = "compressed-tensors"
    FP8 = "fp8"  # transformers' quant_method fp8


class Fp8Layout(Enum):
    PER_TENSOR = "per-tensor"
    PER_CHANNEL = "per-channel"
    BLOCK = "block"


class ActivationScheme(Enum):
    NONE = "none"  # weight-only: activations stay in the activation dtype
    DYNAMIC_PER_TOKEN = "dynamic per token"
    DYNAMIC_PER_TENSOR = "dynamic per tensor"
    DYNAMIC_PER_GROUP = "dynamic per group of 128"
    STATIC_PER_TENSOR = "static per tensor"  # the checkpoint's `input_scale`


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    """How the weights of one group of modules are stored."""

    layout: Fp8Layout
    scale_names: tuple[str, ...]  # the scale tensor's suffix after "<module>.", in preference order
    activations: ActivationScheme
    block_size: tuple[int, int] | None = None  # (rows, columns) of a tile, BLOCK only

    def describe(self) -> str:
        layout = self.layout.value if self.block_size is None else "block {}x{}".format(*self.block_size)
        return f"{layout}, activations {self.activations.value}"


@dataclass(frozen=True, slots=True)
class ModuleMatcher:
    """Which Linear modules a list of config entries names, compiled once (checkpoints with
    thousands of experts ask about every one)."""

    patterns: tuple[re.Pattern[str], ...] = ()
    names: frozenset[str] = frozenset()
    suffixes: tuple[str, ...] = ()
    every_linear: bool = False
    covers_children: bool = False  # a name also covers the modules under it

    def matches(self, module: str) -> bool:
        if self.every_linear or module in self.names or module.endswith(self.suffixes):
            return True
        if self.covers_children:
            parts = module.split(".")
            if any(".".join(parts[:depth]) in self.names for depth in range(1, len(parts))):
                return True
        return any(pattern.match(module) for pattern in self.patterns)


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """A checkpoint's FP8 description: which Linear modules are quantized and how."""

    format: CheckpointFormat
    groups: tuple[tuple[Fp8Scheme, ModuleMatcher], ...]  # (scheme, its targets), first match wins
    ignore: ModuleMatcher

    def scheme_for(self, module: str) -> Fp8Scheme | None:
        """The scheme of Linear `module` (e.g. "model.layers.0.mlp.down_proj"); None: unquantized."""
        if self.ignore.matches(module):
            return None
        return next((scheme for scheme, targets in self.groups if targets.matches(module)), None)

    @property
    def layouts(self) -> frozenset[Fp8Layout]:
        return frozenset(scheme.layout for scheme, _ in self.groups)

    def describe(self) -> str:
        """One line for logs and errors, e.g. "fp8 (block 128x128, activations dynamic per group of 128)"."""
        return f"{self.format.value} ({'; '.join(sorted({scheme.describe() for scheme, _ in self.groups}))})"


def read_quantization(raw_config: Mapping[str, Any]) -> Fp8Checkpoint | None:
    """Classify config.json's `quantization_config`: None when there is none (bf16/f16/f32
    weights) or when the loader dequantizes it (MXFP4 experts of `MXFP4_ARCHITECTURES`), an
    `Fp8Checkpoint` when Atlas can load it; raises `QuantizationError` naming what it cannot
    load (method, format, bits, strategy, activation scheme, block size, architecture)."""
    config = raw_config.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise QuantizationError(f"must be an object, got {type(config).__name__}")
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    if method == "fp8":
        return _fine_grained_fp8(config)
    if method == "mxfp4":
        architecture = (raw_config.get("architectures") or [None])[0]
        if architecture not in MXFP4_ARCHITECTURES:
            raise QuantizationError(f"quant_method 'mxfp4' is loaded for {', '.join(MXFP4_ARCHITECTURES)} only, "
                                    f"not {architecture}")
        return None
    raise QuantizationError(f"quant_method {method!r} is not supported")


def check_quantization(raw_config: Mapping[str, Any], loadable: Collection[Fp8Layout],
                       architecture: str | None = None) -> Fp8Checkpoint | None:
    """`read_quantization`, then refuse a recognised FP8 layout the model loader cannot build yet
    (`loadable`: the layouts it can; none for a loader of float weights only, which the message
    names by `architecture`). The builder calls this before reading any weight."""
    checkpoint = read_quantization(raw_config)
    if checkpoint is not None and not checkpoint.layouts <= set(loadable):
        if not loadable and architecture is not None:
            reason = (f"this build loads {architecture} from float weights only; "
                      "use its bf16 checkpoint, without --quantization")
        else:
            reason = "this build cannot load FP8 weights of that layout yet; use the model's bf16 checkpoint"
        raise QuantizationError(f"{checkpoint.describe()} is recognised, but {reason}", name_supported=False)
    return checkpoint


# -- compressed-tensors -------------------------------------------------------------------------


def _compressed_tensors(config: Mapping[str, Any]) -> Fp8Checkpoint:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise QuantizationError(f"quantization_status {status!r}: only compressed checkpoints store FP8 weights")
    for key in ("sparsity_config", "transform_config"):
        value = config.get(key)
        if value and not (key == "sparsity_config" and isinstance(value, Mapping) and value.get("format") == "dense"):
            raise QuantizationError(f"{key} is not supported")
    _check_kv_cache_scheme(config.get("kv_cache_scheme"))
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizationError("compressed-tensors without config_groups")
    parsed = []
    for name, group in groups.items():
        if not isinstance(group, Mapping):
            raise QuantizationError(f"config group {name!r} is not an object")
        form = group.get("format") or config.get("format")
        if form != "float-quantized":
            raise QuantizationError(f"config group {name!r} has format {form!r}")
        if group.get("output_activations") is not None:
            raise QuantizationError(f"config group {name!r} quantizes output activations")
        targets = _names(f"config group {name!r} targets", group.get("targets"))
        for target in targets:
            if _is_class_name(target) and target != "Linear":
                raise QuantizationError(f"config group {name!r} targets {target!r}; only Linear layers can be FP8")
        layout, block_size = _ct_weights(name, group.get("weights"))
        activations = _ct_activations(name, group.get("input_activations"))
        scheme = Fp8Scheme(layout, ("weight_scale",), activations, block_size)
        parsed.append((scheme, _ct_matcher(targets, covers_children=False)))
    ignore = _ct_matcher(_names("ignore", config.get("ignore")), covers_children=True)
    return Fp8Checkpoint(CheckpointFormat.COMPRESSED_TENSORS, tuple(parsed), ignore)


_CT_LAYOUTS = {"tensor": Fp8Layout.PER_TENSOR, "channel": Fp8Layout.PER_CHANNEL, "block": Fp8Layout.BLOCK}


def _ct_weights(group: str, weights: Any) -> tuple[Fp8Layout, tuple[int, int] | None]:
    where = f"config group {group!r} weights"
    if not isinstance(weights, Mapping):
        raise QuantizationError(f"{where} are missing")
    _check_float8(where, weights)
    if weights.get("dynamic"):
        raise QuantizationError(f"{where} are dynamic")
    layout = _CT_LAYOUTS.get(weights.get("strategy"))  # type: ignore[arg-type]
    if layout is None:
        raise QuantizationError(f"{where} have strategy {weights.get('strategy')!r}, not tensor, channel or block")
    if weights.get("actorder"):
        raise QuantizationError(f"{where} use actorder")
    if layout is not Fp8Layout.BLOCK:
        return layout, None
    block = weights.get("block_structure")
    if not _is_block_size(block):
        raise QuantizationError(f"{where} use block_structure {block!r}, not [128, 128]")
    return layout, BLOCK_SIZE


def _ct_activations(group: str, activations: Any) -> ActivationScheme:
    if activations is None:
        return ActivationScheme.NONE
    where = f"config group {group!r} input_activations"
    if not isinstance(activations, Mapping):
        raise QuantizationError(f"{where} is not an object")
    _check_float8(where, activations)
    strategy, dynamic = activations.get("strategy"), activations.get("dynamic")
    if strategy == "token" and dynamic is True:
        return ActivationScheme.DYNAMIC_PER_TOKEN
    if strategy == "tensor":
        return ActivationScheme.DYNAMIC_PER_TENSOR if dynamic is True else ActivationScheme.STATIC_PER_TENSOR
    if strategy == "group" and dynamic is True and activations.get("group_size") == BLOCK_SIZE[1]:
        return ActivationScheme.DYNAMIC_PER_GROUP
    raise QuantizationError(f"{where}: strategy {strategy!r} with dynamic {dynamic!r} is not supported")


def _check_float8(where: str, args: Mapping[str, Any]) -> None:
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise QuantizationError(f"{where} are {args.get('num_bits')}-bit {args.get('type')}, not 8-bit float")
    if args.get("symmetric", True) is not True:
        raise QuantizationError(f"{where} are asymmetric")


def _check_kv_cache_scheme(scheme: Any) -> None:
    """An FP8 per-tensor KV scheme is what `--kv-cache-dtype fp8` reads (k_scale / v_scale)."""
    if scheme is None:
        return
    if not isinstance(scheme, Mapping) or scheme.get("strategy") != "tensor" or scheme.get("dynamic"):
        raise QuantizationError("kv_cache_scheme other than static per-tensor is not supported")
    _check_float8("kv_cache_scheme", scheme)


def _is_block_size(value: Any) -> bool:
    """Whether a config's block shape (a JSON list) is the one Atlas loads, [128, 128]."""
    return isinstance(value, Sequence) and not isinstance(value, str) and list(value) == list(BLOCK_SIZE)


def _names(key: str, value: Any) -> list[str]:
    """A config's list of module names or patterns (null: none). Raises QuantizationError naming
    `key` for anything else: a lone string would otherwise be read a character at a time."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(f"{key} must be a list of module names, got {value!r}", name_supported=False)
    return list(value)


def _is_class_name(entry: str) -> bool:
    return not entry.startswith("re:") and "." not in entry and entry[:1].isupper()


def _ct_matcher(entries: list[str], covers_children: bool) -> ModuleMatcher:
    """compressed-tensors' forms: "re:" + a regex matched from the start, a class name (only
    "Linear" can name a Linear module), or an exact module name."""
    patterns = tuple(_compile(entry[3:], entry[3:]) for entry in entries if entry.startswith("re:"))
    names = frozenset(entry for entry in entries if not entry.startswith("re:") and not _is_class_name(entry))
    return ModuleMatcher(patterns, names, every_linear="Linear" in entries, covers_children=covers_children)


def _compile(regex: str, entry: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as error:
        raise QuantizationError(f"module pattern {entry!r} is not a valid regex ({error})") from None


# -- transformers' fp8 ----------------------------------------------------------------------------


def _fine_grained_fp8(config: Mapping[str, Any]) -> Fp8Checkpoint:
    if config.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"fmt {config.get('fmt')!r} is not e4m3")
    if config.get("scale_fmt", "float") != "float":
        raise QuantizationError(f"scale_fmt {config.get('scale_fmt')!r} (only float scales)")
    if config.get("expert_dtype", "fp8") != "fp8":
        raise QuantizationError(f"expert_dtype {config.get('expert_dtype')!r} (only fp8 experts)")
    if config.get("modules_to_convert"):
        raise QuantizationError("modules_to_convert (FP8 embeddings) is not supported")
    scheme_name = config.get("activation_scheme", "dynamic")
    if scheme_name not in ("dynamic", "static"):
        raise QuantizationError(f"activation_scheme {scheme_name!r} is not dynamic or static")
    block = config.get("weight_block_size")
    if block is None:
        static = scheme_name == "static"
        activations = ActivationScheme.STATIC_PER_TENSOR if static else ActivationScheme.DYNAMIC_PER_TENSOR
        scheme = Fp8Scheme(Fp8Layout.PER_TENSOR, ("weight_scale", "weight_scale_inv"), activations)
    elif not _is_block_size(block):
        raise QuantizationError(f"weight_block_size {block!r} is not [128, 128]")
    elif scheme_name == "static":
        raise QuantizationError("activation_scheme static with weight_block_size is not supported")
    else:
        scheme = Fp8Scheme(Fp8Layout.BLOCK, ("weight_scale_inv",), ActivationScheme.DYNAMIC_PER_GROUP, BLOCK_SIZE)
    skip_key = "modules_to_not_convert" if config.get("modules_to_not_convert") else "ignored_layers"
    skipped = _names(skip_key, config.get(skip_key))
    # transformers' rule: a key skips a module it matches as a regex from the start up to a
    # module boundary ("mlp.gate" is not "mlp.gate_proj"), or as a plain suffix.
    patterns = tuple(_compile(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", key) for key in skipped)
    ignore = ModuleMatcher(patterns, suffixes=tuple(skipped))
    return Fp8Checkpoint(CheckpointFormat.FP8, ((scheme, ModuleMatcher(every_linear=True)),), ignore)


# -- --quantization fp8 ---------------------------------------------------------------------------

QUANTIZE_AT_LOAD = "fp8"
PER_CHANNEL_AT_LOAD: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "channel"},
            "input_activations": None,
        }
    },
    "ignore": ["lm_head"],
}
"""What `--quantization fp8` makes of a bf16 checkpoint: llm-compressor's per-channel layout, so
the loaders read it as they read a published one (quantization_weights.QuantizedOnLoad)."""


def with_quantization(raw_config: Mapping[str, Any], quantization: str | None) -> dict[str, Any]:
    """config.json as the loaders should see it under `--quantization` (None: as it is).

    Raises `QuantizationError` for a method other than "fp8", or for a checkpoint that already
    carries a `quantization_config` (its weights are quantized already)."""
    if quantization is None:
        return dict(raw_config)
    if quantization != QUANTIZE_AT_LOAD:
        raise QuantizationError(f"--quantization {quantization!r}: only {QUANTIZE_AT_LOAD!r} is supported",
                                name_supported=False)
    if raw_config.get("quantization_config") is not None:
        method = raw_config["quantization_config"].get("quant_method") if isinstance(
            raw_config["quantization_config"], Mapping) else None
        raise QuantizationError(
            f"the checkpoint is quantized already ({method}); drop --quantization {quantization}",
            name_supported=False,
        )
    return {**raw_config, "quantization_config": PER_CHANNEL_AT_LOAD}
