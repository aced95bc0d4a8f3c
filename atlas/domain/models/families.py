"""Which loader builds which `architectures` entry of config.json."""

from __future__ import annotations

from collections.abc import Callable

from atlas.domain.models import llama
from atlas.domain.models.config import ModelConfig
from atlas.domain.models.transformer import Transformer
from atlas.ports.gpu import GpuBackend
from atlas.ports.weights import WeightSource

Loader = Callable[..., Transformer]

_LOADERS: dict[str, Loader] = {name: llama.load_llama_family for name in llama.ARCHITECTURES}


class UnsupportedArchitectureError(ValueError):
    """config.json names an architecture no loader handles."""


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_LOADERS))


def check_supported(config: ModelConfig) -> None:
    """Raise before any weight is read when the architecture has no loader."""
    if config.architecture not in _LOADERS:
        raise UnsupportedArchitectureError(
            f"architecture {config.architecture!r} is not supported; supported: {', '.join(supported_architectures())}"
        )


def load_model(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: Callable[[int, int], None] | None = None,
) -> Transformer:
    """Build the model for `config` on `backend`; see `check_supported` for the error."""
    check_supported(config)
    return _LOADERS[config.architecture](config, weights, backend, max_positions, progress)
