"""The attention kind: the paged KV cache of a cache group, a layer's q/k/v with RoPE into it, and
attention over it.

A layer's attention is two members around its output projection (a dense `project_add`):

    project(residual, layer, meta, cache, q)   # rmsnorm, q|k|v product, q/k norms, RoPE,
                                               # K and V into the cache, rotated q out
    attend(q, layer, meta, cache, out)         # causal attention (window, sinks, soft-cap, gate)

What varies between families (q/k norms, partial rotary, the RoPE table of the layer's type, a
sliding window, sinks, logit soft-capping, a gated output, FP8 K/V scales) is data of the layer
(`AttentionLayer`, `HostAttention`, `KvCacheSpec`); how it is fused is the backend's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from atlas.ports.gpu import DType, Tensor
from atlas.ports.kernels.host_weights import HostLinear, RmsNorm


@dataclass(frozen=True, slots=True)
class HeadLayout:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    """Shape of the paged KV cache of one cache group: `num_blocks` pages of `block_size` tokens
    for each of its `num_layers` layers.

    A token's slot is `block_id * block_size + offset_in_block`; the layout of a page in
    memory is the backend's business. A quantized dtype (FP8 E4M3) stores K / k_scale and
    V / v_scale, one pair of scales per layer (`scales`; empty means 1.0 everywhere).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    scales: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.scales and len(self.scales) != self.num_layers:
            raise ValueError(f"scales: {len(self.scales)} pairs for {self.num_layers} layers")
        if any(not (scale > 0 and math.isfinite(scale)) for pair in self.scales for scale in pair):
            raise ValueError("scales: every K and V scale must be positive and finite")

    def layer_scales(self, layer: int) -> tuple[float, float]:
        """(k_scale, v_scale) of `layer`: what a stored value is multiplied by to give K or V."""
        return self.scales[layer] if self.scales else (1.0, 1.0)

    @property
    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


class KvCache(Protocol):
    """The K and V pages of every layer of a cache group (`AttentionKernels.allocate_cache`)."""

    @property
    def spec(self) -> KvCacheSpec: ...


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of a step sits, for RoPE, the KV write and attention.

    The step is a varlen batch: sequence `s` contributes query tokens
    `query_start_loc[s] : query_start_loc[s + 1]`, which are the last tokens of its context of
    `seq_lens[s]` tokens (prefill chunks and decodes mix freely).

        tokens     | s0: 5 prompt tokens | s1: 1 decode | s2: chunk of 3 |
        query_start_loc = [0, 5, 6, 9]
        seq_lens        = [5, 40, 19]      (s2 had 16 tokens cached before this chunk)
        positions       = [0 1 2 3 4 | 39 | 16 17 18]
        slot_mapping[t] = block_tables[s][pos // block_size] * block_size + pos % block_size

    Each KV cache group of a model has its own slot mapping and block table (a sliding-window
    group's table may point entries its window no longer reads at any page, and a row may be
    wider than the blocks it names: only entries of positions in the context are read).

    Decode rows whose contexts open with the same pages may be named in `shared_prefix`
    ([2 + num_seqs] i32: prefix length in tokens, anchor row, then 1 for each row that shares
    the anchor's first `prefix length` tokens; written like the rest). A backend may read those
    pages once for all of them (cascade attention); the result is the same attention. The
    prefix holds only full pages before each sharing row's newest token.

    The tensors are device buffers the runner updates in place, so a captured graph replays
    with new contents. The integers are host-side bounds the backend may use to pick kernels;
    a graph captured with given bounds is only replayed for steps within them
    (`shared_prefix_len` > 0: the step has a shared prefix, of at least that many tokens).
    """

    positions: Tensor  # [N] i32
    slot_mapping: Tensor  # [N] i32
    query_start_loc: Tensor  # [num_seqs + 1] i32
    seq_lens: Tensor  # [num_seqs] i32
    block_tables: Tensor  # [num_seqs, max_blocks_per_seq] i32
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    shared_prefix: Tensor | None = None  # [num_seqs + 2] i32, see above
    shared_prefix_len: int = 0


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """What one attention layer computes, besides its weights.

    cache_layer: its layer within the KV cache of its cache group.
    scale: the softmax scale (head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5).
    rope_table: [max_positions, r] cos | sin of each position's angles (r <= head_dim; the first
        r dims of each head rotate, "half-split": pairs (i, i + r/2)), shared by the layers of a
        type; None: no rotation.
    sliding_window: a query at position p sees keys at p - window + 1 .. p; None: all.
    logit_softcap: scores = c * tanh(scores / c) before the mask (Gemma 2).
    gated_output: the q projection also gives a gate per q head (Qwen3-Next); the output is
        attention * sigmoid(gate).
    """

    heads: HeadLayout
    cache_layer: int
    scale: float
    rope_table: Tensor | None
    sliding_window: int | None = None
    logit_softcap: float | None = None
    gated_output: bool = False

    @property
    def q_width(self) -> int:
        """Width of `project`'s q output: the q heads, then the gate heads of a gated layer."""
        return self.heads.q_size * (2 if self.gated_output else 1)


@dataclass(frozen=True, slots=True)
class HostAttention:
    """An attention layer's weights before its output projection.

    input_norm: the RMSNorm of the residual stream before the product.
    qkv: [q_width + 2 Hkv D, H]: the q heads ([Hq D]), a gated layer's gate heads ([Hq D], in
        the q heads' order), then the k heads and the v heads. Bias optional.
    q_norm, k_norm: RMSNorms of each q and k head ([D]) before RoPE (Qwen3, Gemma 3).
    sinks: [Hq] f32 per-head logits that join each softmax's denominator without a value (GPT-OSS).
    """

    input_norm: RmsNorm
    qkv: HostLinear
    q_norm: RmsNorm | None = None
    k_norm: RmsNorm | None = None
    sinks: np.ndarray | None = None


class PreparedAttention(Protocol):
    """A backend's prepared attention layer (opaque): its weights and its `AttentionLayer`."""


class AttentionKernels(Protocol):
    def allocate_cache(self, spec: KvCacheSpec) -> KvCache:
        """The paged cache of a cache group. Raises `MemoryError` saying how many blocks would
        fit, and `ValueError` for a dtype outside `Capabilities.kv_dtypes` or a head dim the
        backend has no kernels for."""
        ...

    def prepare(self, host: HostAttention, layer: AttentionLayer) -> PreparedAttention:
        """The backend's form of one layer, made once at load. Raises `UnsupportedError` naming
        what it cannot run (a head dim, sinks, soft-capping, a gated output, a weight format)."""
        ...

    def project(
        self, x: Tensor, layer: PreparedAttention, meta: AttentionMetadata, cache: KvCache, q_out: Tensor
    ) -> None:
        """q, k, v of the step's tokens: n = rmsnorm(x, input_norm); [q | gate | k | v] =
        n @ qkv.T (+ bias); each q and k head through q_norm / k_norm if given; q and k rotated by
        the layer's table at `meta.positions`; k and v stored into `cache` at
        `meta.slot_mapping` (layer `cache_layer`; quantized with its scales for an FP8 cache;
        a slot of -1 stores nothing); rotated q (then the gate) into q_out.
        x [N, H] (the residual stream, only read), q_out [N, q_width]."""
        ...

    def attend(
        self, q: Tensor, layer: PreparedAttention, meta: AttentionMetadata, cache: KvCache, out: Tensor
    ) -> None:
        """Causal attention of each query token over its sequence's cached context.

        q [N, q_width] as `project` wrote it, out [N, Hq * D]. The query token at position p of
        sequence s attends to the cached positions max(0, p - window + 1) .. p of s, read through
        `meta.block_tables`; query head h reads kv head h // (Hq / Hkv). Scores are
        scale * q.k (soft-capped where the layer says); softmax over them and the head's sink;
        out = softmax @ v, times sigmoid(gate) for a gated layer."""
        ...
