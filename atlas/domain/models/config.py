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
    factor: float | None = 1.0  # yarn: None means max_position_embeddings / original_max_position_embeddings
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int | None = None  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    attention_factor: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions (GPT-OSS: false)


@dataclass(frozen=True, slots=True)
class Rope:
    """One rotary embedding: its base frequency and scaling."""

    theta: float
    scaling: RopeScaling = RopeScaling()


SUPPORTED_ROPE_KINDS = ("default", "linear", "llama3", "yarn")

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

# Families whose layer types follow a pattern when config.json has no `layer_types`: every
# `period`-th layer is full attention, the others slide (transformers' `sliding_window_pattern`).
_LAYER_PATTERNS = {"gemma3_text": 6, "gpt_oss": 2}
# Families whose config.json may leave out `tie_word_embeddings` because transformers' default ties.
_TIED_BY_DEFAULT = ("gemma3_text",)
# RoPE bases transformers assumes where config.json names none: (full or every layer, sliding layers).
_DEFAULT_THETAS = {"gemma3_text": (1_000_000.0, 10_000.0), "gpt_oss": (150_000.0, None)}


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
    rope_theta: float  # every layer's RoPE; the full-attention layers' where `sliding_rope` is set
    rope_scaling: RopeScaling
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama and Qwen3 o_proj too)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None
    hidden_act: str
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per-layer attention: `layer_types[i]` is FULL_ATTENTION or SLIDING_ATTENTION (empty: every
    # layer alike, sliding where `sliding_window` is set); the sliding layers' own RoPE (Gemma 3).
    layer_types: tuple[str, ...] = ()
    sliding_rope: Rope | None = None
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Mixture of experts: routed experts on the layers `is_moe_layer` names, dense GLUs elsewhere.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mlp_bias: bool = False  # Llama's gate/up/down projections carry a bias
    swiglu_alpha: float = 1.702  # GPT-OSS's clamped SwiGLU
    swiglu_limit: float = 7.0
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        text = cfg.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in cfg:
            # a vision-language checkpoint (Qwen3.5): its language model's fields are nested
            cfg = {**{key: value for key, value in cfg.items() if key != "text_config"}, **text,
                   "architectures": cfg.get("architectures")}
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ModelConfigError("config.json has no 'architectures' entry; cannot tell which model this is")
        architecture = architectures[0]
        try:
            hidden_size = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_layers = int(cfg["num_hidden_layers"])
            model_type = str(cfg.get("model_type", ""))
            head_dim = int(cfg.get("head_dim") or hidden_size // num_heads)
            rope, sliding_rope = _ropes(cfg, model_type)
            partial = cfg.get("partial_rotary_factor", _flat_rope_parameters(cfg).get("partial_rotary_factor", 1.0))
            intermediate_size = int(cfg["intermediate_size"])
            num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
            return cls(
                architecture=architecture,
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=intermediate_size,
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope.theta,
                rope_scaling=rope.scaling,
                rotary_dim=int(head_dim * float(partial)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
                # transformers' Qwen2 biases q/k/v whatever the config says; GPT-OSS reads the key (default on)
                attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", model_type == "gpt_oss")),
                qk_norm=model_type in ("qwen3", "qwen3_moe"),
                sliding_window=_sliding_window(cfg),
                hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=_ids(cfg.get("eos_token_id")),
                layer_types=_layer_types(cfg, model_type, num_layers),
                sliding_rope=sliding_rope,
                query_pre_attn_scalar=_optional_float(cfg.get("query_pre_attn_scalar")),
                attn_logit_softcap=_optional_float(cfg.get("attn_logit_softcapping")),
                final_logit_softcap=_optional_float(cfg.get("final_logit_softcapping")),
                num_experts=num_experts,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if num_experts else 0,
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or intermediate_size) if num_experts else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=tuple(int(layer) for layer in cfg.get("mlp_only_layers") or ()),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
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
        for rope in (self.rope_scaling, self.sliding_rope.scaling if self.sliding_rope else None):
            if rope is not None and rope.kind not in SUPPORTED_ROPE_KINDS:
                raise ModelConfigError(
                    f"rope_scaling type {rope.kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_KINDS)}"
                )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries for num_hidden_layers {self.num_layers}"
            )

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` attends over a sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == SLIDING_ATTENTION

    def layer_window(self, layer: int) -> int | None:
        """The window `layer` attends over (None: the whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope(self, layer: int) -> Rope:
        """The RoPE of `layer`: the sliding layers' own where the config gives one."""
        if self.sliding_rope is not None and self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_rope
        return Rope(self.rope_theta, self.rope_scaling)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is the mixture of experts (transformers' rule:
        not in `mlp_only_layers`, and every `decoder_sparse_step`-th layer)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        """K and V elements per token over all layers (multiply by the KV dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads * d) * 2 + h * (self.num_kv_heads * d) * 2
        dense = 3 * h * self.intermediate_size
        experts = self.num_experts * (3 * h * self.moe_intermediate_size + h)  # their GLUs and the router
        mlps = sum(experts if self.is_moe_layer(layer) else dense for layer in range(self.num_layers))
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlps + embed + h


def _flat_rope_parameters(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters`; older configs `rope_theta` + `rope_scaling`."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    return params


def _ropes(cfg: Mapping[str, Any], model_type: str) -> tuple[Rope, Rope | None]:
    """(every layer's RoPE, or the full-attention layers' where the sliding ones have their own;
    the sliding layers' own RoPE or None).

    transformers >= 5 writes per-type parameters as `rope_parameters: {"full_attention": {...},
    "sliding_attention": {...}}`; older Gemma 3 configs give `rope_theta` and `rope_scaling` for
    the full layers and `rope_local_base_freq` for the sliding ones.
    """
    full_theta, sliding_theta = _DEFAULT_THETAS.get(model_type, (10_000.0, None))
    nested = cfg.get("rope_parameters") or {}
    if any(isinstance(nested.get(kind), Mapping) for kind in (FULL_ATTENTION, SLIDING_ATTENTION)):
        full = dict(nested.get(FULL_ATTENTION) or {})
        sliding = dict(nested.get(SLIDING_ATTENTION) or {})
        sliding_rope = Rope(float(sliding.get("rope_theta", sliding_theta or full_theta)), _rope_scaling(sliding))
        return Rope(float(full.get("rope_theta", full_theta)), _rope_scaling(full)), sliding_rope
    params = _flat_rope_parameters(cfg)
    rope = Rope(float(params.get("rope_theta", cfg.get("rope_theta", full_theta))), _rope_scaling(params))
    local = cfg.get("rope_local_base_freq", sliding_theta)
    return rope, (Rope(float(local)) if local is not None else None)


def _rope_scaling(rope: Mapping[str, Any]) -> RopeScaling:
    kind = str(rope.get("rope_type", rope.get("type", "default")))
    if kind == "default" or not rope:
        return RopeScaling()
    factor = rope.get("factor")
    return RopeScaling(
        kind=kind,
        factor=float(factor) if factor is not None else (None if kind == "yarn" else 1.0),
        low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"),
        truncate=bool(rope.get("truncate", True)),
    )


def _layer_types(cfg: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[str, ...]:
    """config.json's `layer_types`, else the family's pattern (`sliding_window_pattern`; Qwen2 and
    Qwen3 slide from layer `max_window_layers` on), else ()."""
    given = cfg.get("layer_types")
    if given is not None:
        return tuple(str(kind) for kind in given)
    if model_type in ("qwen2", "qwen3") and _sliding_window(cfg) is not None:
        first = int(cfg.get("max_window_layers", 28))  # transformers' default
        return tuple(SLIDING_ATTENTION if layer >= first else FULL_ATTENTION for layer in range(num_layers))
    period = cfg.get("sliding_window_pattern", _LAYER_PATTERNS.get(model_type))
    if period is None:
        return ()
    period = int(period)
    return tuple(SLIDING_ATTENTION if (layer + 1) % period else FULL_ATTENTION for layer in range(num_layers))


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if cfg.get("model_type") in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
