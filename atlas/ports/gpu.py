"""The device port: memory, the ops a transformer step needs, and graph capture.

Everything the engine computes goes through a `GpuBackend`. The mock adapter runs each op in
numpy with real math; the CUDA adapter runs our kernels and cuBLASLt. Both must agree with the
numpy reference to the tolerances in `tests/contract`.

Conventions for every op:
- Outputs are caller-provided tensors written in full; ops never allocate on the hot path.
- Tensors are dense and row-major. `Tensor.rows(a, b)` and `Tensor.view(...)` give views that
  share memory, so a workspace sized for the largest step serves every smaller one.
- Shapes are given in comments as `[rows, cols]`; `N` is the number of tokens in the step,
  `R` the number of rows to sample, `H` the hidden size, `V` the vocabulary size.
- Ops are enqueued in order on one stream. `download` and `synchronize` wait for them.
- An op that is given inconsistent shapes or dtypes raises `ValueError` naming the argument.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"
    I32 = "i32"
    I64 = "i64"
    U8 = "u8"
    FP8_E4M3 = "fp8_e4m3"  # OCP E4M3 (max 448, no infinities): quantized KV caches

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.BF16, DType.F16, DType.F32)

    @property
    def is_quantized(self) -> bool:
        """Stored values that stand for value * scale (the scale kept beside them)."""
        return self is DType.FP8_E4M3


_ITEMSIZE = {
    DType.BF16: 2, DType.F16: 2, DType.F32: 4, DType.I32: 4, DType.I64: 8, DType.U8: 1, DType.FP8_E4M3: 1,
}

# How each dtype looks on the host: what `upload` takes and `download` returns.
NUMPY_DTYPES: dict[DType, np.dtype] = {
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.F16: np.dtype(np.float16),
    DType.F32: np.dtype(np.float32),
    DType.I32: np.dtype(np.int32),
    DType.I64: np.dtype(np.int64),
    DType.U8: np.dtype(np.uint8),
    DType.FP8_E4M3: np.dtype(ml_dtypes.float8_e4m3fn),
}


def dtype_of(array: np.ndarray) -> DType:
    """The port dtype of a host array; `ValueError` for one no backend holds."""
    for dtype, np_dtype in NUMPY_DTYPES.items():
        if array.dtype == np_dtype:
            return dtype
    raise ValueError(f"no backend dtype for numpy dtype {array.dtype}")


class Activation(enum.Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation


def bitcast_last_dim(shape: tuple[int, ...], source: DType, target: DType) -> int:
    """The last dimension of a tensor of `shape` and `source` read as `target` (see
    `Tensor.bitcast`); raises ValueError when the bytes do not divide."""
    if not shape:
        raise ValueError("cannot bitcast a scalar")
    row_bytes = shape[-1] * source.itemsize
    if row_bytes % target.itemsize:
        raise ValueError(f"cannot bitcast {list(shape)} {source.value} to {target.value}")
    return row_bytes // target.itemsize


@runtime_checkable
class Tensor(Protocol):
    """A dense, row-major array owned by a backend."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> DType: ...

    def view(self, *shape: int) -> Tensor:
        """The same memory with another shape of equal element count."""
        ...

    def rows(self, start: int, stop: int) -> Tensor:
        """Rows [start, stop) along dimension 0, sharing memory."""
        ...

    def bitcast(self, dtype: DType) -> Tensor:
        """The same bytes as another dtype; the last dimension scales by the itemsize ratio (a
        [2n] i32 tensor is [n] i64). For word arenas: one copy can carry ints and floats."""
        ...


@dataclass(frozen=True, slots=True)
class KvCacheSpec:
    """Shape of the paged KV cache: `num_blocks` pages of `block_size` tokens per layer.

    A token's slot is `block_id * block_size + offset_in_block`; the layout of a page in
    memory is the adapter's business. A quantized dtype (FP8 E4M3) stores K / k_scale and
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
    """The paged K and V pages of every layer, allocated by `GpuBackend.allocate_kv_cache`."""

    @property
    def spec(self) -> KvCacheSpec: ...


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

    The tensors are device buffers the runner updates in place, so a captured graph replays
    with new contents. The integers are host-side bounds the adapter may use to pick kernels;
    a graph captured with given bounds is only replayed for steps within them.
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


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters for `GpuBackend.sample`, in the order rules apply:

    1. penalties over the row's context (`penalty_*` CSR): repetition (divide positive logits,
       multiply negative ones) for every token seen in prompt or output; presence and frequency
       (subtract `presence + frequency * count`) for tokens in the output;
    2. logit bias (`bias_*` CSR; -inf bans a token);
    3. temperature; a row with temperature 0 is greedy (argmax of the biased logits);
    4. top-k (0 = off), then top-p over the renormalised top-k set, then min-p
       (keep p >= min_p * max p);
    5. draw with the row's counter-based random stream (`seeds`, `counters`): the same seed and
       counter give the same token whatever else is in the batch.

    The draw is a Gumbel-max race, defined bit for bit so every backend picks the same id.
    In wrapping uint64 arithmetic, for row r and token id v:

        x = seed ^ (counter * 0x9E3779B97F4A7C15) ^ (v * 0xD1B54A32D192ED03)
        x = splitmix64(x)   # x += 0x9E3779B97F4A7C15; x = (x ^ x >> 30) * 0xBF58476D1CE4E5B9;
                            # x = (x ^ x >> 27) * 0x94D049BB133111EB; x ^= x >> 31
        u = ((x >> 41) + 0.5) * 2**-23          # float32, exactly representable, in (0, 1)
                                                # (23 bits: with 24 the top value rounds to 1.0)
        token = argmax over kept v of  logit_v / T - log(-log(u))   (ties: lowest id)

    Greedy rows take argmax of the processed logits (ties: lowest id). Top-k keeps the k
    largest (ties: lowest id); top-p keeps, in descending probability, each token whose
    preceding cumulative probability is < top_p (so at least one); min-p compares
    exp((logit_v - logit_max) / T) with min_p.
    """

    temperature: Tensor  # [R] f32
    top_k: Tensor  # [R] i32, 0 = off
    top_p: Tensor  # [R] f32, 1 = off
    min_p: Tensor  # [R] f32, 0 = off
    seeds: Tensor  # [R] i64
    counters: Tensor  # [R] i64, how many tokens the row has sampled before
    repetition_penalty: Tensor  # [R] f32, 1 = off
    presence_penalty: Tensor  # [R] f32
    frequency_penalty: Tensor  # [R] f32
    penalty_offsets: Tensor  # [R + 1] i32
    penalty_token_ids: Tensor  # [P] i32, distinct per row
    penalty_output_counts: Tensor  # [P] i32, occurrences in the output (0: prompt only)
    bias_offsets: Tensor  # [R + 1] i32
    bias_token_ids: Tensor  # [B] i32
    bias_values: Tensor  # [B] f32
    num_rows: int
    all_greedy: bool
    any_penalties: bool
    any_bias: bool


@dataclass(frozen=True, slots=True)
class LogprobsOut:
    """Where `sample` writes log-probabilities of the raw (unprocessed) logits."""

    sampled: Tensor  # [R] f32, log p of the chosen token
    top_ids: Tensor  # [R, K] i32, the K most likely tokens, most likely first
    top_logprobs: Tensor  # [R, K] f32
    num_top: int  # K, may be 0


@dataclass(frozen=True, slots=True)
class Capabilities:
    activation_dtype: DType  # what the model keeps activations in (f32 on the mock, bf16 on GPUs)
    kv_dtypes: tuple[DType, ...]
    supports_graphs: bool  # replay is cheaper than eager launches
    device_name: str


class PendingDownload(Protocol):
    def wait(self) -> np.ndarray:
        """Block until the copy has landed; return it (the same array on every call)."""
        ...


class Graph(Protocol):
    def replay(self) -> None:
        """Run the captured ops again, reading the current contents of their buffers."""
        ...


@runtime_checkable
class GpuBackend(Protocol):
    """A device that holds tensors and runs the ops of one transformer step."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    # -- memory -------------------------------------------------------------------------
    def empty(self, shape: Sequence[int], dtype: DType) -> Tensor:
        """An uninitialised tensor. Raises `MemoryError` naming the bytes asked and free."""
        ...

    def upload(self, array: np.ndarray, dtype: DType | None = None) -> Tensor:
        """A new tensor holding `array`, converted to `dtype` (default: the array's own)."""
        ...

    def copy_from_host(self, dst: Tensor, array: np.ndarray) -> None:
        """Write `array` (same element count, converted to dst's dtype) into `dst`.

        Ordered with the ops on the stream; `array` may be reused as soon as this returns.
        """
        ...

    def download(self, src: Tensor) -> np.ndarray:
        """A host copy of `src` after every op enqueued before it (bf16 comes back as
        ml_dtypes.bfloat16)."""
        ...

    def begin_download(self, src: Tensor) -> PendingDownload:
        """Start copying `src` to the host once every op enqueued before has run.

        Returns at once; ops enqueued later may overwrite `src` without changing the copy. This
        is how the worker reads step N's token ids while step N+1 is already queued.
        """
        ...

    def fill(self, dst: Tensor, value: float) -> None:
        """Set every element of `dst` to `value` (tests poison outputs with NaN this way)."""
        ...

    def memory_info(self) -> tuple[int, int]:
        """(free_bytes, total_bytes) the backend can still allocate from."""
        ...

    def allocate_kv_cache(self, spec: KvCacheSpec) -> KvCache:
        """The paged cache; raises `MemoryError` saying how many blocks would fit."""
        ...

    def kv_to_host(self, kv: KvCache, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of one layer as [num_blocks, block_size, num_kv_heads, head_dim] (tests)."""
        ...

    # -- ops ----------------------------------------------------------------------------
    def embedding(self, token_ids: Tensor, table: Tensor, out: Tensor) -> None:
        """out[i] = table[token_ids[i]].  token_ids [N] i32, table [V, H], out [N, H]."""
        ...

    def rmsnorm(self, x: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        """out = x / sqrt(mean(x^2) + eps) * weight, per row.  x, out [N, H], weight [H]."""
        ...

    def add_rmsnorm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float, out: Tensor) -> None:
        """residual += x, then out = rmsnorm(residual) * weight (the pre-norm residual stream)."""
        ...

    def linear(self, x: Tensor, weight: Tensor, out: Tensor, bias: Tensor | None = None) -> None:
        """out = x @ weight.T (+ bias).  x [N, K], weight [M, K], out [N, M], bias [M]."""
        ...

    def linear_add(self, x: Tensor, weight: Tensor, residual: Tensor, scratch: Tensor, defer: bool = False) -> bool:
        """`linear(x, weight, scratch)` then residual += scratch (a layer's output projection into
        the residual stream), as one op that a backend may fuse (leaving `scratch` unwritten).
        x [N, K], weight [H, K], residual, scratch [N, H] of the activation dtype.

        With `defer` the backend may stop after the product and return True: the add is then
        the caller's, who passes `scratch` as `add_first` to the norm op that reads `residual`
        next (one kernel for the add and the norm). Returns False when the add is done."""
        ...

    def fold_rmsnorm(self, norm_weight: Tensor, weight: Tensor) -> bool:
        """Prepare a projection that always follows the RMSNorm with `norm_weight` [K] for this
        backend's `rmsnorm_linear`: either leave `weight` [M, K] as it is and return False (the
        model passes `norm_weight`), or scale its columns in place, weight[:, k] *= norm_weight[k]
        rounded once to the weight's type, and return True (the model then passes None: the norm
        weight is in the product). Called once per projection when a model is loaded; never on a
        matrix that anything else reads (a tied embedding)."""
        ...

    def rmsnorm_linear(
        self,
        x: Tensor,
        norm_weight: Tensor | None,
        eps: float,
        weight: Tensor,
        out: Tensor,
        normed: Tensor,
        bias: Tensor | None = None,
        add_first: Tensor | None = None,
    ) -> None:
        """out = rmsnorm(x) @ weight.T (+ bias): `rmsnorm(x, norm_weight, eps, normed)` then
        `linear(normed, weight, out, bias)`, as one op so that a backend may normalise x inside
        the product (and leave `normed` unwritten). x, normed [N, K], weight [M, K], out [N, M].
        norm_weight None: `weight` carries it (`fold_rmsnorm`), x is normalised without one.
        add_first [N, K]: a product `linear_add` deferred; x += add_first (rounded to x's type,
        x being the residual stream) before anything reads x."""
        ...

    def rmsnorm_gated_linear(
        self,
        x: Tensor,
        norm_weight: Tensor | None,
        eps: float,
        weight: Tensor,
        activation: Activation,
        out: Tensor,
        normed: Tensor,
        scratch: Tensor,
        add_first: Tensor | None = None,
    ) -> None:
        """`rmsnorm(x, norm_weight, eps, normed)`, `linear(normed, weight, scratch)`, then
        `act_mul(scratch, activation, out)`: out = act(n @ gate.T) * (n @ up.T) with n = rmsnorm(x)
        and weight = [gate; up] [2I, K], as one op that a backend may fuse (leaving `normed` and
        `scratch` [N, 2I] unwritten). x [N, K], out [N, I]. norm_weight None and add_first: as
        `rmsnorm_linear`."""
        ...

    def rope_and_cache(
        self,
        qkv: Tensor,
        meta: AttentionMetadata,
        rope_table: Tensor,
        kv: KvCache,
        layer: int,
        heads: HeadLayout,
        q_out: Tensor,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
        norm_eps: float = 1e-6,
    ) -> None:
        """Split a fused projection, rotate, and store K/V in the paged cache.

        qkv [N, (Hq + 2 Hkv) * D] holds q, k, v heads side by side. If given, `q_norm`/`k_norm`
        ([D]) RMS-normalise each head first (Qwen3). Then q and k are rotated "half-split"
        style (pairs (i, i + r/2) of the first r dims) with `rope_table` [max_pos, r] holding
        cos for the first r/2 columns and sin for the rest, indexed by `meta.positions`.
        Rotated q goes to q_out [N, Hq * D]; k and v go to `meta.slot_mapping` slots of layer
        `layer` in `kv`.
        """
        ...

    def qkv_rope_cache(
        self,
        x: Tensor,
        norm_weight: Tensor | None,
        eps: float,
        weight: Tensor,
        bias: Tensor | None,
        meta: AttentionMetadata,
        rope_table: Tensor,
        kv: KvCache,
        layer: int,
        heads: HeadLayout,
        q_out: Tensor,
        qkv: Tensor,
        normed: Tensor,
        q_norm: Tensor | None = None,
        k_norm: Tensor | None = None,
        add_first: Tensor | None = None,
    ) -> None:
        """An attention layer's input: `rmsnorm_linear(x, norm_weight, eps, weight, qkv, normed,
        bias, add_first)` then `rope_and_cache(qkv, meta, rope_table, kv, layer, heads, q_out,
        q_norm, k_norm, eps)`, as one op that a backend may fuse (leaving `qkv` and `normed`
        unwritten). x, normed [N, H], weight [(Hq + 2 Hkv) * D, H], qkv [N, (Hq + 2 Hkv) * D].
        norm_weight None and add_first: as `rmsnorm_linear`."""
        ...

    def attention(
        self,
        q: Tensor,
        kv: KvCache,
        layer: int,
        meta: AttentionMetadata,
        heads: HeadLayout,
        scale: float,
        out: Tensor,
        sliding_window: int | None = None,
    ) -> None:
        """Causal attention of each query token over its sequence's cached context.

        q, out [N, Hq * D]. Query token at position p of sequence s attends to positions
        max(0, p - sliding_window + 1) .. p of s, read through `meta.block_tables`; query head
        h reads kv head h // (Hq / Hkv).
        """
        ...

    def act_mul(self, x: Tensor, activation: Activation, out: Tensor) -> None:
        """out = act(x[:, :I]) * x[:, I:].  x [N, 2I], out [N, I]."""
        ...

    def gather_rows(self, x: Tensor, indices: Tensor, out: Tensor) -> None:
        """out[r] = x[indices[r]].  x [N, H], indices [R] i32, out [R, H]."""
        ...

    def sample(
        self,
        logits: Tensor,
        params: SamplingTensors,
        out_token_ids: Tensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        """One token per row of logits [R, V] into out_token_ids [R] i32 (see SamplingTensors)."""
        ...

    def copy_blocks(self, kv: KvCache, src_block_ids: Tensor, dst_block_ids: Tensor) -> None:
        """Copy pages src[i] -> dst[i] in every layer.  Both [C] i32."""
        ...

    # -- execution ----------------------------------------------------------------------
    def capture(self, fn: Callable[[], None]) -> Graph:
        """Record the ops `fn` enqueues so `replay` reruns them on the buffers' new contents.

        `fn` may only enqueue ops on tensors that outlive the graph; it must not download,
        upload or allocate. Backends without graphs run `fn` on every replay.
        """
        ...

    def synchronize(self) -> None:
        """Wait until every enqueued op has finished."""
        ...
