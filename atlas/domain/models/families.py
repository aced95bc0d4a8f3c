"""Which loader builds which `architectures` entry of config.json, and the kinds it needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from atlas.domain.models import gemma3, gpt_oss, llama, qwen3_moe, qwen3_next
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import Fp8Layout
from atlas.ports.gpu import GpuBackend, Kind, require_kinds
from atlas.ports.weights import WeightSource


@dataclass(frozen=True, slots=True)
class Family:
    """A loader and the kernel kinds the models it builds call (sampling aside: every model
    samples); `reads_fp8`: whether it reads FP8 projections (through a `CheckpointReader` given
    the checkpoint's quantization) or float weights only."""

    kinds: Callable[[ModelConfig], frozenset[Kind]]
    load: Callable[..., Model]
    reads_fp8: bool = True


_FAMILIES: dict[str, Family] = {
    **{name: Family(llama.kinds, llama.load_llama_family) for name in llama.ARCHITECTURES},
    **{name: Family(qwen3_moe.kinds, qwen3_moe.load_qwen3_moe) for name in qwen3_moe.ARCHITECTURES},
    **{name: Family(gemma3.kinds, gemma3.load_gemma3) for name in gemma3.ARCHITECTURES},
    **{name: Family(gpt_oss.kinds, gpt_oss.load_gpt_oss, reads_fp8=False) for name in gpt_oss.ARCHITECTURES},
    **{name: Family(qwen3_next.kinds, qwen3_next.load_qwen3_next) for name in qwen3_next.ARCHITECTURES},
}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture no loader handles."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def check_supported(config: ModelConfig) -> None:
    """Raise before any weight is read when the architecture has no loader."""
    if config.architecture not in _FAMILIES:
        raise UnsupportedArchitectureError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )


def model_kinds(config: ModelConfig) -> frozenset[Kind]:
    """The kernel kinds a model of `config` calls, known before any weight is read (sampling
    aside). Raises `UnsupportedArchitectureError` like `check_supported`."""
    check_supported(config)
    return _FAMILIES[config.architecture].kinds(config)


def fp8_layouts(config: ModelConfig) -> tuple[Fp8Layout, ...]:
    """The FP8 layouts the loader of `config`'s architecture reads: every published one, or none
    for a loader of float weights only. Raises `UnsupportedArchitectureError` like `check_supported`."""
    check_supported(config)
    return tuple(Fp8Layout) if _FAMILIES[config.architecture].reads_fp8 else ()


def load_model(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Build the model for `config` on `backend`. Before any weight is read, raises
    `UnsupportedArchitectureError` (see `check_supported`) or `MissingKindError` naming the
    kernel kinds the model needs and the backend lacks."""
    check_supported(config)
    family = _FAMILIES[config.architecture]
    require_kinds(backend, family.kinds(config) | {Kind.SAMPLING}, config.architecture)
    return family.load(config, weights, backend, max_positions, progress)


def kv_cache_scales(config: ModelConfig, weights: WeightSource) -> tuple[tuple[float, float], ...]:
    """Per-layer (k_scale, v_scale) of a quantized KV cache, as FP8 checkpoints store them
    (`model.layers.N.self_attn.k_scale` and `.v_scale`, or one `.kv_scale` for both); 1.0 where
    the checkpoint has none, as in vLLM, which suits activations within FP8 E4M3's +-448."""
    scales = []
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}.self_attn."
        both = _scalar(weights, prefix + "kv_scale", 1.0)
        scales.append((_scalar(weights, prefix + "k_scale", both), _scalar(weights, prefix + "v_scale", both)))
    return tuple(scales)


def _scalar(weights: WeightSource, name: str, default: float) -> float:
    if name not in weights:
        return default
    values = weights.get(name).astype("float32").reshape(-1)
    if values.size != 1 or not values[0] > 0:
        raise ValueError(f"tensor {name!r}: a KV cache scale must be one positive number (got {values[:4]})")
    return float(values[0])
