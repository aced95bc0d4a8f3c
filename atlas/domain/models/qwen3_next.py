"""The Qwen3-Next loader: a hybrid of Gated DeltaNet and gated attention layers over MoE; also
Qwen3.5 (the same layers over a dense GLU) and Qwen3.5-MoE, text-only or the language model of
their vision-language checkpoints (`model.language_model.*`, config.json's `text_config`; the
vision tower is not loaded). Text positions make their multimodal RoPE the plain partial RoPE.

    layer_types      linear_attention x 3, full_attention, ... (full_attention_interval 4)
    linear_attention rmsnorm -> in_proj -> causal conv1d -> gated delta rule -> gated rmsnorm -> out_proj
                     (Qwen3-Next: in_proj_qkvz and in_proj_ba, grouped per key head; Qwen3.5:
                     in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each all heads in order)
    full_attention   rmsnorm -> q (with a gate per head), k, v -> q/k rmsnorm -> partial RoPE (the
                     first quarter of each head) -> attention * sigmoid(gate) -> o_proj
    feed-forward     rmsnorm -> top-k of E experts (softmax, renormalised) + a shared expert
                     scaled by sigmoid(x @ shared_expert_gate); a dense GLU in `mlp_only_layers`

Every RMSNorm of the residual stream, and the q/k norms, is zero-centred: the checkpoint stores
w for a multiplier (1 + w), which this loader hands to the kinds as a plain multiplier; the
gated norm inside a DeltaNet layer stores its multiplier itself. The cache groups are the
DeltaNet layers' state slots and the attention layers' KV pages.

Checkpoints also carry a multi-token-prediction head (`mtp.*`), which transformers drops on
load; `load_mtp` reads it into an `MtpModule`, which `draft_heads.mtp_head` runs as the draft
head of `--speculative-config '{"method": "mtp", ...}'`.

FP8 checkpoints (Qwen3-Next-80B-A3B-FP8: 128 x 128 blocks; llm-compressor's layouts) load each
projection as stored, FP8 with its scales or float where `quantization_config` leaves it so
(published: the router, shared_expert_gate and in_proj_ba), experts and the MTP head included.
The projections whose rows this loader regroups (q_proj's q | gate, in_proj_qkvz | in_proj_ba)
stay FP8 where whole 128-row tiles move (every published head size); where a tile would be cut,
or FP8 rows meet float ones (the published in_proj_ba), they are dequantized at load to the
backend's float weights (`CheckpointReader.regrouped_linear`): the DeltaNet in_proj of a
published checkpoint runs in bf16, its kernel taking one layout for all six parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from atlas.domain.models import decoder
from atlas.domain.models.cache_groups import CacheGroupSpec, KvShape, StateShape, group_caches, locate
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.feed_forward import DenseFeedForward, MoeFeedForward
from atlas.domain.models.layers import FeedForward, Layer
from atlas.domain.models.mixers import AttentionMixer, DeltaNetMixer
from atlas.domain.models.model import Model
from atlas.domain.models.quantization_config import read_quantization
from atlas.domain.models.quantization_weights import QuantizedWeight, host_linear, stack_experts, take_columns
from atlas.domain.models.rope import rope_table
from atlas.ports.gpu import DType, GpuBackend, Kind, Tensor
from atlas.ports.kernels.attention import AttentionLayer, HeadLayout, HostAttention
from atlas.ports.kernels.dense import HostProjection, HostVocab, Projection, Vocab
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing, Scoring
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet
from atlas.ports.weights import WeightError, WeightSource

ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
# Qwen3.5-MoE's router renormalises its top k whatever norm_topk_prob says (transformers'
# Qwen3VLMoeTextTopKRouter), as Qwen3-Next's does when the field is true.
_ALWAYS_RENORMALISED = ("qwen3_5_moe_text", "qwen3_5_moe")
LINEAR, FULL = "linear_attention", "full_attention"
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25  # what transformers assumes when config.json names none


@dataclass(frozen=True, slots=True)
class Qwen3NextShape:
    """What config.json says of a Qwen3-Next beyond `ModelConfig`."""

    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    mlp_only_layers: frozenset[int]
    decoder_sparse_step: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> Qwen3NextShape:
        """Raises ModelConfigError naming a missing or inconsistent field."""
        raw: Mapping[str, Any] = config.raw
        try:
            interval = int(raw.get("full_attention_interval", 4))
            layer_types = tuple(raw.get("layer_types") or (
                FULL if (index + 1) % interval == 0 else LINEAR for index in range(config.num_layers)
            ))
            shape = cls(
                layer_types=layer_types,
                linear_num_key_heads=int(raw["linear_num_key_heads"]),
                linear_num_value_heads=int(raw["linear_num_value_heads"]),
                linear_key_head_dim=int(raw["linear_key_head_dim"]),
                linear_value_head_dim=int(raw["linear_value_head_dim"]),
                linear_conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
                num_experts=int(raw.get("num_experts", 0)),
                num_experts_per_tok=int(raw.get("num_experts_per_tok", 0)),
                moe_intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
                norm_topk_prob=bool(raw.get("norm_topk_prob", True)) or config.model_type in _ALWAYS_RENORMALISED,
                mlp_only_layers=frozenset(int(layer) for layer in raw.get("mlp_only_layers") or ()),
                decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
            )
        except KeyError as exc:
            raise ModelConfigError(f"config.json is missing the Qwen3-Next field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ModelConfigError(f"config.json has a malformed Qwen3-Next value: {exc}") from None
        shape._check(config.num_layers)
        return shape

    def _check(self, num_layers: int) -> None:
        if len(self.layer_types) != num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ModelConfigError(
                f"layer_types must list {LINEAR!r} or {FULL!r} for each of the {num_layers} layers "
                f"(got {list(self.layer_types)})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if any(self.is_moe(layer) for layer in range(num_layers)) and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ModelConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts = {self.num_experts}] "
                f"and moe_intermediate_size positive"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the MoE block (else a dense GLU), as
        transformers decides it."""
        return layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0

    def delta_net(self, state_layer: int) -> DeltaNetLayer:
        return DeltaNetLayer(
            state_layer, self.linear_num_key_heads, self.linear_num_value_heads, self.linear_key_head_dim,
            self.linear_value_head_dim, self.linear_conv_kernel,
        )


def kinds(config: ModelConfig) -> frozenset[Kind]:
    """The kernel kinds a model of this family calls."""
    shape = Qwen3NextShape.from_config(config)
    needed = {Kind.DENSE}
    if LINEAR in shape.layer_types:
        needed.add(Kind.RECURRENT)
    if FULL in shape.layer_types:
        needed.add(Kind.ATTENTION)
    if any(shape.is_moe(layer) for layer in range(config.num_layers)):
        needed.add(Kind.MOE)
    return frozenset(needed)


def cache_groups(config: ModelConfig, shape: Qwen3NextShape) -> tuple[CacheGroupSpec, ...]:
    """The DeltaNet layers' state slots and the attention layers' KV pages, as data."""
    state = shape.delta_net(0)
    kv = KvShape(config.num_kv_heads, config.head_dim)
    recurrent = StateShape(state.conv_dim, state.conv_kernel, state.num_value_heads, state.key_head_dim,
                           state.value_head_dim)
    return group_caches([recurrent if kind == LINEAR else kv for kind in shape.layer_types])


def load_qwen3_next(
    config: ModelConfig,
    weights: WeightSource,
    backend: GpuBackend,
    max_positions: int,
    progress: decoder.ProgressCallback | None = None,
) -> Model:
    """Build a `Model` from a Qwen3-Next checkpoint (its `mtp.*` head is left to `load_mtp`);
    raises WeightError naming a missing or misshapen tensor, ModelConfigError for config.json."""
    shape = Qwen3NextShape.from_config(config)
    reader = CheckpointReader(weights, read_quantization(config.raw))
    builder = _LayerBuilder(config, shape, reader, backend, max_positions)
    groups = cache_groups(config, shape)

    def layer(index: int) -> Layer:
        prefix = f"{builder.model_prefix}layers.{index}."
        group, position = locate(groups, index)
        if shape.layer_types[index] == LINEAR:
            mixer = builder.delta_net(prefix, group, position)
        else:
            mixer = builder.attention(prefix, group, position)
        return Layer(mixer, builder.feed_forward(prefix, shape.is_moe(index)))

    def vocab() -> Vocab:
        return backend.dense.prepare_vocab(builder.vocab())

    return decoder.assemble(config, backend, groups, layer, vocab, progress)


@dataclass(frozen=True, slots=True)
class MtpModule:
    """Qwen3-Next's multi-token-prediction head, prepared on a backend, for speculative decoding
    (`draft_heads.mtp_head`). Given the main model's hidden state h_t (before its final norm)
    and the embedding of token t + 1, it predicts token t + 2:

        x = embedding_projection(embed(t + 1)) + hidden_projection(h_t)
            (fc over [norm_e(embed) | norm_h(h)], split by columns into the two projections)
        x = layers(x)                    full attention + MoE, over its own `cache_groups`
        logits = lm_head(rmsnorm(x, final_norm))     the main model's lm_head

    `vocab` is the main model's embedding and lm_head with `final_norm` as its final norm (the
    dense kind's head applies its vocabulary's own norm): a second copy of the tables on the
    device, until a backend can share them between two vocabularies.
    """

    embedding_projection: Projection  # pre_fc_norm_embedding, fc[:, :H]
    hidden_projection: Projection  # pre_fc_norm_hidden, fc[:, H:] (a project_add into the first)
    layers: tuple[Layer, ...]
    cache_groups: tuple[CacheGroupSpec, ...]
    final_norm: RmsNorm
    hidden_size: int
    vocab: Vocab


def load_mtp(config: ModelConfig, weights: WeightSource, backend: GpuBackend, max_positions: int) -> MtpModule | None:
    """The checkpoint's MTP head (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.N.*`, `mtp.norm`),
    or None where it has none. Raises WeightError naming a missing or misshapen tensor."""
    names = [name for name in weights.names() if name.startswith("mtp.")]
    if not names:
        return None
    num_layers = 1 + max((int(name.split(".")[2]) for name in names if name.startswith("mtp.layers.")), default=-1)
    if num_layers == 0:
        raise WeightError("the checkpoint's MTP head (mtp.*) has no layers (mtp.layers.0.*)")
    shape = Qwen3NextShape.from_config(config)
    reader = CheckpointReader(weights, read_quantization(config.raw))
    builder = _LayerBuilder(config, shape, reader, backend, max_positions)
    hidden = config.hidden_size
    groups = group_caches([KvShape(config.num_kv_heads, config.head_dim)] * num_layers)
    layers = tuple(
        Layer(
            builder.attention(f"mtp.layers.{index}.", 0, index),
            builder.feed_forward(f"mtp.layers.{index}.", f"mtp.layers.{index}.mlp.gate.weight" in reader),
        )
        for index in range(num_layers)
    )
    embedding_fc, hidden_fc = _split_columns(reader.stored("mtp.fc", hidden, 2 * hidden), hidden)
    dense = backend.dense
    return MtpModule(
        embedding_projection=dense.prepare(HostProjection(embedding_fc, builder.norm("mtp.pre_fc_norm_embedding"))),
        hidden_projection=dense.prepare(HostProjection(hidden_fc, builder.norm("mtp.pre_fc_norm_hidden"))),
        layers=layers,
        cache_groups=groups,
        final_norm=builder.norm("mtp.norm"),
        hidden_size=hidden,
        vocab=dense.prepare_vocab(replace(builder.vocab(), final_norm=builder.norm("mtp.norm"))),
    )


class _LayerBuilder:
    """Maps one layer's checkpoint tensors onto the layer kinds (shared by the model's layers
    and the MTP head's)."""

    def __init__(
        self, config: ModelConfig, shape: Qwen3NextShape, reader: CheckpointReader, backend: GpuBackend,
        max_positions: int,
    ) -> None:
        self.config, self.shape, self.reader, self.backend = config, shape, reader, backend
        self._table: Tensor | None = None
        self._max_positions = max_positions
        # a vision-language checkpoint (Qwen3.5's) keeps its language model apart from the vision tower
        language_model = "model.language_model."
        self.model_prefix = language_model if f"{language_model}embed_tokens.weight" in reader else "model."

    def norm(self, name: str, width: int | None = None) -> RmsNorm:
        """A zero-centred RMSNorm: the multiplier is 1 + the stored weight."""
        weight = self.reader.array(f"{name}.weight", (width or self.config.hidden_size,))
        return RmsNorm(np.asarray(weight, np.float32) + np.float32(1.0), self.config.rms_norm_eps)

    def rope(self) -> Tensor:
        """The RoPE table of the first `rotary_dim` dims of each head, uploaded once."""
        if self._table is None:
            config = self.config
            raw_factor = config.raw.get("partial_rotary_factor", (config.raw.get("rope_parameters") or {}).get(
                "partial_rotary_factor"))
            if raw_factor is None:  # transformers' default for this family, not ModelConfig's 1.0
                config = replace(config, rotary_dim=int(config.head_dim * DEFAULT_PARTIAL_ROTARY_FACTOR))
            self._table = self.backend.upload(rope_table(config, self._max_positions), DType.F32)
        return self._table

    def attention(self, prefix: str, group: int, cache_layer: int) -> AttentionMixer:
        config, reader = self.config, self.reader
        hidden, head_dim = config.hidden_size, config.head_dim
        heads = HeadLayout(config.num_heads, config.num_kv_heads, head_dim)
        p = prefix + "self_attn."
        # q_proj holds, per head, its D query rows then its D gate rows: regroup as all q, all gates
        q_rows = np.arange(2 * heads.q_size).reshape(heads.num_q_heads, 2, head_dim).transpose(1, 0, 2).reshape(-1)
        qkv = reader.regrouped_linear([
            (p + "q_proj", 2 * heads.q_size, q_rows), (p + "k_proj", heads.kv_size, None),
            (p + "v_proj", heads.kv_size, None),
        ], hidden)  # fmt: skip
        bias = None
        if config.attention_bias:
            q_bias = reader.array(p + "q_proj.bias", (2 * heads.q_size,)).reshape(heads.num_q_heads, 2, head_dim)
            bias = np.concatenate([q_bias[:, 0].reshape(-1), q_bias[:, 1].reshape(-1),
                                   reader.array(p + "k_proj.bias", (heads.kv_size,)),
                                   reader.array(p + "v_proj.bias", (heads.kv_size,))])
        host = HostAttention(
            self.norm(prefix + "input_layernorm"), replace(qkv, bias=bias),
            q_norm=self.norm(p + "q_norm", head_dim), k_norm=self.norm(p + "k_norm", head_dim),
        )
        spec = AttentionLayer(heads, cache_layer, head_dim**-0.5, self.rope(), gated_output=True)
        o_proj = reader.linear(p + "o_proj", hidden, heads.q_size, bias=config.attention_bias)
        return AttentionMixer(spec, group, self.backend.attention.prepare(host, spec),
                              self.backend.dense.prepare(HostProjection(o_proj)), hidden)

    def delta_net(self, prefix: str, group: int, state_layer: int) -> DeltaNetMixer:
        reader, hidden, eps = self.reader, self.config.hidden_size, self.config.rms_norm_eps
        spec = self.shape.delta_net(state_layer)
        p = prefix + "linear_attn."
        if p + "in_proj_qkv.weight" in reader:  # Qwen3.5: already all q, all k, all v, all z, all b, all a
            in_proj = reader.regrouped_linear([
                (p + "in_proj_qkv", 2 * spec.key_dim + spec.value_dim, None), (p + "in_proj_z", spec.value_dim, None),
                (p + "in_proj_b", spec.num_value_heads, None), (p + "in_proj_a", spec.num_value_heads, None),
            ], hidden)  # fmt: skip
        else:
            in_proj = reader.regrouped_linear([
                (p + "in_proj_qkvz", 2 * spec.key_dim + 2 * spec.value_dim, qkvz_rows(spec)),
                (p + "in_proj_ba", 2 * spec.num_value_heads, ba_rows(spec)),
            ], hidden)  # fmt: skip
        host = HostDeltaNet(
            conv_weight=reader.array(p + "conv1d.weight", (spec.conv_dim, 1, spec.conv_kernel))[:, 0],
            a_log=reader.array(p + "A_log", (spec.num_value_heads,)),
            dt_bias=reader.array(p + "dt_bias", (spec.num_value_heads,)),
            norm=reader.norm(p + "norm.weight", spec.value_head_dim, eps),  # a plain multiplier
        )
        dense = self.backend.dense
        return DeltaNetMixer(
            spec, group, dense.prepare(HostProjection(in_proj, self.norm(prefix + "input_layernorm"))),
            self.backend.recurrent.prepare(host, spec),
            dense.prepare(HostProjection(reader.linear(p + "out_proj", hidden, spec.value_dim))), hidden,
        )

    def feed_forward(self, prefix: str, moe: bool) -> FeedForward:
        config, reader, dense = self.config, self.reader, self.backend.dense
        hidden, p = config.hidden_size, prefix + "mlp."
        norm = self.norm(prefix + "post_attention_layernorm")
        if not moe:
            inter = config.intermediate_size
            gate_up = _gate_up(reader, p, inter, hidden)
            return DenseFeedForward(
                dense.prepare(HostProjection(gate_up, norm, Activation.SILU)),
                dense.prepare(HostProjection(reader.linear(p + "down_proj", hidden, inter))), inter, hidden,
            )
        shape = self.shape
        num_experts, inter, shared = shape.num_experts, shape.moe_intermediate_size, shape.shared_expert_intermediate_size
        gate_up, down = _experts(reader, p + "experts.", num_experts, inter, hidden)
        shared_expert = None
        if shared:
            shared_expert = HostSharedExpert(
                _gate_up(reader, p + "shared_expert.", shared, hidden),
                reader.linear(p + "shared_expert.down_proj", hidden, shared),
                reader.linear(p + "shared_expert_gate", 1, hidden),
            )
        routing = Routing(num_experts, shape.num_experts_per_tok, Scoring.SOFTMAX, renormalize=shape.norm_topk_prob)
        host = HostMoe(norm, reader.linear(p + "gate", num_experts, hidden), gate_up, down, Activation.SILU, routing,
                       shared=shared_expert)
        return MoeFeedForward(self.backend.moe.prepare(host), routing.top_k, hidden, max(inter, shared))

    def vocab(self) -> HostVocab:
        config, reader = self.config, self.reader
        lm_head = None
        if not config.tie_word_embeddings:
            lm_head = reader.linear("lm_head", config.vocab_size, config.hidden_size)
        embedding = reader.array(f"{self.model_prefix}embed_tokens.weight", (config.vocab_size, config.hidden_size))
        return HostVocab(embedding, self.norm(f"{self.model_prefix}norm"), lm_head)


def _gate_up(reader: CheckpointReader, prefix: str, inter: int, hidden: int) -> HostLinear:
    return reader.stacked_linear([(f"{prefix}gate_proj", inter), (f"{prefix}up_proj", inter)], hidden)  # float or FP8


def _experts(
    reader: CheckpointReader, prefix: str, num_experts: int, inter: int, hidden: int
) -> tuple[HostLinear, HostLinear]:
    """([E, 2I, H] gate rows then up rows, [E, H, I]) from one tensor per expert and matrix (as
    the published checkpoints store them, float or FP8 with their scales) or from transformers'
    fused `gate_up_proj` and `down_proj` (float)."""
    if f"{prefix}gate_up_proj" in reader:
        return (HostLinear(reader.array(f"{prefix}gate_up_proj", (num_experts, 2 * inter, hidden))),
                HostLinear(reader.array(f"{prefix}down_proj", (num_experts, hidden, inter))))
    gate_up = [_gate_up(reader, f"{prefix}{expert}.", inter, hidden) for expert in range(num_experts)]
    down = [reader.linear(f"{prefix}{expert}.down_proj", hidden, inter) for expert in range(num_experts)]
    try:
        return stack_experts(gate_up), stack_experts(down)
    except ValueError as error:
        what = "FP8 and float experts, or different scale layouts"
        raise WeightError(f"{prefix.rstrip('.')}: {error} ({what})") from None


def _split_columns(fc: np.ndarray | QuantizedWeight, hidden: int) -> tuple[HostLinear, HostLinear]:
    """mtp.fc [H, 2H] as its two projections, over the embedding's columns [:H] and the hidden
    state's [H:]: float, or FP8 with the rows' scales (block scales where H falls on a tile
    boundary, as in every published size; else dequantized to float)."""
    if not isinstance(fc, QuantizedWeight):
        return HostLinear(np.ascontiguousarray(fc[:, :hidden])), HostLinear(np.ascontiguousarray(fc[:, hidden:]))
    try:
        return host_linear(take_columns(fc, 0, hidden)), host_linear(take_columns(fc, hidden, 2 * hidden))
    except ValueError:
        values = fc.dequantize()
        return HostLinear(values[:, :hidden]), HostLinear(values[:, hidden:])


def qkvz_rows(layer: DeltaNetLayer) -> np.ndarray:
    """Rows of the checkpoint's in_proj_qkvz (per key head: its q, its k, its value heads' v,
    then their z) in `DeltaNetLayer`'s order (all q, all k, all v, all z)."""
    dk, group_v = layer.key_head_dim, layer.num_value_heads // layer.num_key_heads * layer.value_head_dim
    per_head = 2 * dk + 2 * group_v
    starts = np.arange(layer.num_key_heads) * per_head
    parts = [(0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + group_v), (2 * dk + group_v, per_head)]
    return np.concatenate([np.arange(start + lo, start + hi) for lo, hi in parts for start in starts])


def ba_rows(layer: DeltaNetLayer) -> np.ndarray:
    """Rows of the checkpoint's in_proj_ba (per key head: its value heads' b, then their a) as
    all b, then all a."""
    group = layer.num_value_heads // layer.num_key_heads
    starts = np.arange(layer.num_key_heads) * 2 * group
    return np.concatenate([np.arange(start + lo, start + lo + group) for lo in (0, group) for start in starts])
