"""EAGLE-3 draft heads in the common checkpoint format (as vLLM and SGLang load them), run as a
`Model` over the target's hidden states.

    config.json   architectures ["LlamaForCausalLMEagle3"] (or "Eagle3LlamaForCausalLM"), one
                  Llama decoder layer's sizes, draft_vocab_size, optionally target_hidden_size
                  and eagle_config.eagle_aux_hidden_state_layer_ids
    tensors       fc [H, 3 Ht]; midlayer.{input_layernorm, hidden_norm, self_attn.{q,k,v,o}_proj,
                  post_attention_layernorm, mlp.{gate,up,down}_proj}; norm; lm_head [Vd, H];
                  d2t [Vd] (target id = draft id + d2t[draft id]); t2d; embed_tokens (optional:
                  else the target's). Names may also carry `model.`, and `layers.0.` for `midlayer.`

The target hands over the residual stream entering each of three layers (ids a, b, c: the
outputs of layers a - 1, b - 1, c - 1), by default (2, L / 2, L - 3) as vLLM takes them. The
head's step, for token x paired with hidden state g:

    g = fc(target rows)    for a row of the target's (the first draft and the catch-up);
                           a later draft step is fed the head's own output instead
    r = g                                             the head's residual stream
    r += o_proj(attend(qkv([norm_in(embed(x)) | norm_h(r)])))   q/k/v read 2 H columns
    r += mlp(norm_post(r))
    logits = lm_head(norm(r)) over the draft vocabulary; r is the head's output hidden state

The attention kind's members take one input row and normalise it themselves, so the 2 H input is
built as two unit-RMS halves (a norm-only projection each, through an identity matrix) gathered
side by side, with the norm weights folded into the q/k/v columns: the kind's own RMSNorm of a
row of RMS 1 is then the identity (up to its epsilon), and no port grows for one head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlas.domain.models.cache_groups import KvShape, group_caches
from atlas.domain.models.checkpoint import CheckpointReader
from atlas.domain.models.config import ModelConfig, ModelConfigError
from atlas.domain.models.decoder import rope_tables
from atlas.domain.models.feed_forward import DenseFeedForward
from atlas.domain.models.layers import Layer, LayerStep, WorkspaceNeeds
from atlas.domain.models.model import Model
from atlas.ports.gpu import DType, GpuBackend, Kind, Tensor
from atlas.ports.kernels.attention import AttentionLayer, HeadLayout, HostAttention, PreparedAttention
from atlas.ports.kernels.dense import HostProjection, HostVocab, Projection, Vocab
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.weights import WeightError, WeightSource

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3


@dataclass(frozen=True, slots=True)
class Eagle3Shape:
    """What an EAGLE-3 head's config.json says beyond a Llama layer's sizes."""

    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth

    @classmethod
    def from_config(cls, config: ModelConfig) -> Eagle3Shape:
        """Raises ModelConfigError naming a field Atlas cannot run."""
        raw: Mapping[str, Any] = config.raw
        if config.architecture not in ARCHITECTURES:
            raise ModelConfigError(f"architectures: {config.architecture!r} is not an EAGLE-3 head; expected one of "
                                   f"{', '.join(ARCHITECTURES)}")
        if config.num_layers != 1:
            raise ModelConfigError(f"num_hidden_layers: {config.num_layers}; Atlas runs EAGLE-3 heads of one layer")
        eagle = raw.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ModelConfigError("eagle_config.use_aux_hidden_state: false is not supported (heads fed one layer)")
        if raw.get("norm_before_residual"):
            raise ModelConfigError("norm_before_residual: true is not supported yet")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (len(ids) != NUM_AUX_LAYERS or not all(isinstance(i, int) for i in ids)):
            raise ModelConfigError(f"eagle_config.eagle_aux_hidden_state_layer_ids: {ids!r} is not three layer ids")
        return cls(
            draft_vocab_size=int(raw.get("draft_vocab_size") or config.vocab_size),
            target_hidden_size=int(raw.get("target_hidden_size") or config.hidden_size),
            aux_layer_ids=tuple(ids) if ids is not None else None,
        )

    def target_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs the head reads (layer id i's input is layer i - 1's
        output). Raises ModelConfigError for an id outside 1 .. L - 1."""
        count = num_target_layers
        ids = self.aux_layer_ids or (2, count // 2, count - 3)
        if not all(1 <= i < count for i in ids):
            raise ModelConfigError(f"eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)}: the target's "
                                   f"{count} layers take ids 1 .. {count - 1}")
        return tuple(i - 1 for i in ids)


class HeadWeights:
    """A head checkpoint's tensors under one spelling: `midlayer.*` and top-level names, whether
    stored so, under `model.`, or with `layers.0.` for `midlayer.` (a `WeightSource`)."""

    def __init__(self, weights: WeightSource) -> None:
        self._weights = weights
        self._names: dict[str, str] = {}
        for stored in weights.names():
            name = stored.removeprefix("model.")
            name = "midlayer." + name.removeprefix("layers.0.") if name.startswith("layers.0.") else name
            self._names[name] = stored

    def names(self):
        return self._names.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self._weights.shape(self._names[name])

    def get(self, name: str) -> np.ndarray:
        return self._weights.get(self._names[name])


@dataclass(frozen=True, slots=True)
class Eagle3Buffers:
    """The device rows a head's step reads (for up to `max_tokens` tokens), all persistent so a
    captured graph reads each step's contents.

        hidden     [M, H]    g of each token (fused from the target's rows, or the head's own)
        embedded   [M, H]    the tokens' embeddings
        halves     [2M, H]   rows 0 .. M-1 the unit-RMS embeddings, M .. 2M-1 the unit-RMS g
        interleave [2M] i32  0, M, 1, M + 1, ...: gathers token i's two halves into rows 2i, 2i + 1
        row_ids    [M] i32   0, 1, 2, ...
    """

    max_tokens: int
    hidden: Tensor
    embedded: Tensor
    halves: Tensor
    interleave: Tensor
    row_ids: Tensor

    @classmethod
    def allocate(cls, backend: GpuBackend, max_tokens: int, hidden_size: int) -> Eagle3Buffers:
        dtype = backend.capabilities.activation_dtype
        interleave = np.stack([np.arange(max_tokens), np.arange(max_tokens) + max_tokens], axis=1).reshape(-1)
        return cls(
            max_tokens,
            backend.empty((max_tokens, hidden_size), dtype),
            backend.empty((max_tokens, hidden_size), dtype),
            backend.empty((2 * max_tokens, hidden_size), dtype),
            backend.upload(interleave.astype(np.int32), DType.I32),
            backend.upload(np.arange(max_tokens, dtype=np.int32), DType.I32),
        )


@dataclass(frozen=True, slots=True)
class Eagle3Ends:
    """The head's ends (`VocabEnds`): the residual starts as g (the embeddings go to the layer's
    attention through `buffers`), and the draft vocabulary's logits come out."""

    embedding: Vocab  # the token embedding (the head's or the target's)
    head: Vocab  # lm_head [Vd, H] after the head's norm
    buffers: Eagle3Buffers

    def embed(self, backend: GpuBackend, token_ids: Tensor, out: Tensor) -> None:
        num_tokens = token_ids.shape[0]
        backend.dense.embed(token_ids, self.embedding, self.buffers.embedded.rows(0, num_tokens))
        backend.gather_rows(self.buffers.hidden, self.buffers.row_ids.rows(0, num_tokens), out)

    def logits(self, backend: GpuBackend, hidden: Tensor, out: Tensor) -> None:
        backend.dense.logits(hidden, self.head, out)


@dataclass(frozen=True, slots=True)
class Eagle3Attention:
    """residual += o_proj(attend(qkv([norm_in(embedded) | norm_h(residual)]))) over KV group 0."""

    spec: AttentionLayer
    attention: PreparedAttention  # q/k/v over the 2 H joined row, the norm weights in its columns
    unit_norm: Projection  # x / rms(x) through an identity matrix
    output: Projection
    buffers: Eagle3Buffers
    hidden_size: int

    @property
    def kinds(self) -> frozenset[Kind]:
        return frozenset({Kind.ATTENTION, Kind.DENSE})

    @property
    def needs(self) -> WorkspaceNeeds:
        heads, hidden = self.spec.heads, self.hidden_size
        return WorkspaceNeeds(scratch=(self.spec.q_width, heads.q_size, 2 * hidden),
                              intermediate=2 * hidden + self.spec.q_width + 2 * heads.kv_size)

    def forward(self, step: LayerStep, residual: Tensor) -> None:
        backend, buffers = step.backend, self.buffers
        num_tokens, max_tokens, hidden = step.num_tokens, buffers.max_tokens, self.hidden_size
        halves = buffers.halves
        backend.dense.project(buffers.embedded.rows(0, num_tokens), self.unit_norm, halves.rows(0, num_tokens))
        backend.dense.project(residual, self.unit_norm, halves.rows(max_tokens, max_tokens + num_tokens))
        joined = step.scratch(2, 2 * hidden)  # [N, 2H]: token i's rows 2i and 2i + 1 of [2N, H]
        backend.gather_rows(halves, buffers.interleave.rows(0, 2 * num_tokens), joined.view(2 * num_tokens, hidden))
        meta, cache = step.attention(0)
        queries, attended = step.scratch(0, self.spec.q_width), step.scratch(1, self.spec.heads.q_size)
        backend.attention.project(joined, self.attention, meta, cache, queries)
        backend.attention.attend(queries, self.attention, meta, cache, attended)
        backend.dense.project_add(attended, self.output, residual)


@dataclass(frozen=True, slots=True)
class Eagle3Head:
    """A loaded head: the model the head worker runs, the buffers it reads, the projection that
    fuses the target's rows into g, and each draft id's target id."""

    model: Model
    buffers: Eagle3Buffers
    fuse: Projection  # fc [H, 3 Ht]
    target_ids: np.ndarray  # [Vd] int64: draft id -> target id
    target_layers: tuple[int, ...]


def load_eagle3(config: ModelConfig, weights: WeightSource, backend: GpuBackend, max_positions: int,
                max_tokens: int, target: TargetFacts) -> Eagle3Head:
    """Build the head on `backend` for steps of up to `max_tokens` tokens, reading the target's
    embedding where the head has none. Raises ModelConfigError (config.json) or WeightError
    naming what is missing, misshapen or does not fit the target."""
    shape = Eagle3Shape.from_config(config)
    if shape.target_hidden_size != target.hidden_size:
        raise ModelConfigError(f"target_hidden_size: the head reads hidden states of {shape.target_hidden_size}, "
                               f"the target's are {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise ModelConfigError(f"vocab_size: {config.vocab_size}, the target's is {target.vocab_size}")
    reader = CheckpointReader(HeadWeights(weights))
    hidden, vocab_size, draft_vocab = config.hidden_size, config.vocab_size, shape.draft_vocab_size
    eps = config.rms_norm_eps
    dense = backend.dense
    buffers = Eagle3Buffers.allocate(backend, max_tokens, hidden)
    identity = HostLinear(np.eye(hidden, dtype=np.float32))
    unit_norm = dense.prepare(HostProjection(identity, input_norm=RmsNorm(np.ones(hidden, np.float32), eps)))
    attention = _attention(config, reader, backend, max_positions, buffers, unit_norm)
    inter = config.intermediate_size
    p = "midlayer.mlp."
    feed_forward = DenseFeedForward(
        dense.prepare(HostProjection(HostLinear(reader.stacked([(p + "gate_proj.weight", (inter, hidden)),
                                                                (p + "up_proj.weight", (inter, hidden))])),
                                     reader.norm("midlayer.post_attention_layernorm.weight", hidden, eps),
                                     Activation.SILU)),
        dense.prepare(HostProjection(reader.linear(p + "down_proj", hidden, inter))), inter, hidden,
    )
    if "embed_tokens.weight" in reader:
        table = reader.array("embed_tokens.weight", (vocab_size, hidden))
    else:
        table = target.embedding()
    ones = RmsNorm(np.ones(hidden, np.float32), eps)
    ends = Eagle3Ends(
        dense.prepare_vocab(HostVocab(table, ones, None)),
        dense.prepare_vocab(HostVocab(reader.array("lm_head.weight", (draft_vocab, hidden)),
                                      reader.norm("norm.weight", hidden, eps), None)),
        buffers,
    )
    groups = group_caches([KvShape(config.num_kv_heads, config.head_dim)])
    model = Model(backend, ends.head, (Layer(attention, feed_forward),), groups, hidden, draft_vocab, ends=ends)
    fuse = dense.prepare(HostProjection(reader.linear("fc", hidden, NUM_AUX_LAYERS * shape.target_hidden_size)))
    return Eagle3Head(model, buffers, fuse, _target_ids(reader, draft_vocab, vocab_size),
                      shape.target_layers(target.num_layers))


@dataclass(frozen=True, slots=True)
class TargetFacts:
    """What a head needs of its target: sizes, and its embedding table on demand."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    embedding: Any  # () -> np.ndarray [V, H]


def _attention(config: ModelConfig, reader: CheckpointReader, backend: GpuBackend, max_positions: int,
               buffers: Eagle3Buffers, unit_norm: Projection) -> Eagle3Attention:
    hidden, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
    heads = HeadLayout(config.num_heads, config.num_kv_heads, config.head_dim)
    p = "midlayer.self_attn."
    rows = [("q_proj", heads.q_size), ("k_proj", heads.kv_size), ("v_proj", heads.kv_size)]
    weight = np.asarray(reader.stacked([(f"{p}{name}.weight", (size, 2 * hidden)) for name, size in rows]))
    # the halves arrive at unit RMS: the two norms' weights scale their columns instead
    columns = np.concatenate([np.asarray(reader.array("midlayer.input_layernorm.weight", (hidden,))),
                              np.asarray(reader.array("midlayer.hidden_norm.weight", (hidden,)))]).astype(np.float32)
    qkv_bias = reader.stacked([(f"{p}{name}.bias", (size,)) for name, size in rows]) if bias else None
    qkv = HostLinear(weight.astype(np.float32) * columns, qkv_bias)
    host = HostAttention(RmsNorm(np.ones(2 * hidden, np.float32), eps), qkv)
    table = rope_tables(config, backend, max_positions)[0]
    spec = AttentionLayer(heads, 0, config.head_dim**-0.5, table)
    output = backend.dense.prepare(HostProjection(reader.linear(p + "o_proj", hidden, heads.q_size, bias)))
    return Eagle3Attention(spec, backend.attention.prepare(host, spec), unit_norm, output, buffers, hidden)


def _target_ids(reader: CheckpointReader, draft_vocab: int, vocab_size: int) -> np.ndarray:
    """Each draft id's target id (draft id + d2t); the identity where the draft vocabulary is the
    target's and the head has no d2t. Raises WeightError for a smaller one without d2t, or ids
    outside the target's vocabulary."""
    if "d2t" not in reader:
        if draft_vocab != vocab_size:
            raise WeightError(f"the head has a draft vocabulary of {draft_vocab} ids but no d2t tensor mapping them "
                              f"to the target's {vocab_size}")
        return np.arange(vocab_size, dtype=np.int64)
    offsets = np.asarray(reader.weights.get("d2t")).astype(np.int64).reshape(-1)
    if offsets.shape != (draft_vocab,):
        raise WeightError(f"tensor 'd2t' has shape {offsets.shape}, draft_vocab_size implies ({draft_vocab},)")
    target_ids = np.arange(draft_vocab, dtype=np.int64) + offsets
    if target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise WeightError(f"tensor 'd2t' maps draft ids outside the target's vocabulary of {vocab_size}")
    return target_ids
