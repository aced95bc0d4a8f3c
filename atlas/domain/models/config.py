"""A model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """config.json lacks a field or holds a value Atlas cannot run."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How positions are stretched beyond the trained context (HF `rope_scaling`)."""

    kind: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn


SUPPORTED_ROPE_KINDS = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None
    hidden_act: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ModelConfigError("config.json has no 'architectures' entry; cannot tell which model this is")
        architecture = architectures[0]
        try:
            hidden_size = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            model_type = str(cfg.get("model_type", ""))
            head_dim = int(cfg.get("head_dim") or hidden_size // num_heads)
            rope = _rope_parameters(cfg)
            rotary_dim = int(head_dim * float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))))
            return cls(
                architecture=architecture,
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling(rope),
                rotary_dim=rotary_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                sliding_window=_sliding_window(cfg),
                hidden_act=str(cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_ids(cfg.get("eos_token_id")),
                raw=dict(cfg),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing the field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"config.json has a malformed value: {exc}") from None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ModelConfigError(f"rotary dimension {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.rope_scaling.kind not in SUPPORTED_ROPE_KINDS:
            raise ModelConfigError(
                f"rope_scaling type {self.rope_scaling.kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_KINDS)}"
            )

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        """K and V elements per token over all layers (multiply by the KV dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2
        mlp = 3 * h * i
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + embed + h


def _rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    return params


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling:
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if kind == "default" or not rope:
        return RopeScaling()
    return RopeScaling(
        kind=kind,
        factor=float(rope.get("factor", 1.0)),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
        beta_fast=float(rope.get("beta_fast", 32.0)),
        beta_slow=float(rope.get("beta_slow", 1.0)),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
    )


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if cfg.get("model_type") in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
