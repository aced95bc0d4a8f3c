"""KV-cache ops: fused RoPE + cache write, and paged attention (prefill tiles and split-K decode)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.kv_cache import CudaKvCache
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType
from atlas.ports.kernels.attention import AttentionMetadata, HeadLayout

SUPPORTED_HEAD_DIMS = (64, 128, 256)
_PREFILL_BLOCK_N = 64
# (head_dim, rows per tile) pairs attention_prefill.cu defines.
_PREFILL_VARIANTS = {(64, 128), (128, 128), (128, 64), (256, 64)}
# kernels/sm90/attention_prefill.cu: wgmma kernels for these head dims, with 128-row tiles of two
# warpgroups and K/V tiles of 64 keys (two blocks per SM) or 128 keys (one block per SM). Head dim
# 256 and the `_x` variants live in the module attention_prefill_x (Hopper only, WGMMA_X_MODULE).
WGMMA_KEYS_PER_TILE = {64: 64, 128: 64, 256: 64}
WGMMA_X_MODULE = "attention_prefill_x"
_WGMMA_ROWS = 128
_WGMMA_THREADS = 256
_DECODE_THREADS = 128
# attention_decode_mma_d<D>_w<warps>_s<stages>: warps per block, K/V tiles in each warp's ring.
# Where a head dim has several, `decode_mma_shape` picks by the batch's blocks: the first (the
# default) when none holds them all in one wave; else, of those that do, the one with the fewest
# blocks per SM among those the blocks fill more than half of, or among all that hold them when
# the batch fills none that far (it is then split). Head dim 128 on an H200 (Llama-3.1-8B steps
# at 512 tokens, us, against (4, 3) with two-wave splits): (8, 2) at batch 1 3870 against 3915,
# at 8 4762 against 5039 (one-wave splits, 4927 with (4, 3)), at 16 4652 against 5063; a third
# shape of four blocks per SM, (2, 3), won at batch 48-64 on one H200 and lost on another, so it
# is not kept (docs/cuda-notes.md run 14).
DECODE_MMA_SHAPES = {64: ((4, 3),), 128: ((4, 3), (8, 2)), 256: ((4, 2),)}
# The FP8 cache's kernels (_fp8): a tile is half the bytes. At head dim 128 (H200, Llama-3.1-8B
# heads, 512-token contexts, us per layer, docs/cuda-notes.md run 22) the kernel is bound by its
# per-tile latency more than by bytes, so occupancy wins: (4, 3), four blocks per SM, takes batch
# 64 in one wave (21.9 against 29.7 with (4, 6) and 34.1 for bf16), and 128 (43.1 / 57.4 / 66.1);
# (4, 6) takes batch 32 (13.4 against 17.7 with (4, 3)); (8, 4) batches 1-8 (8 x 512: 9.6 against
# 12.4). Head dims 64 and 256 keep bf16's bytes in flight (not measured).
DECODE_MMA_SHAPES_FP8 = {64: ((4, 6),), 128: ((4, 3), (4, 6), (8, 4)), 256: ((4, 4),)}
# KV cache dtypes the attention kernels read.
KV_DTYPES = (DType.BF16, DType.FP8_E4M3)
_ROPE_WARPS = 4  # heads per block of rope_and_cache (a warp each)
_MAX_SPLITS = 128
_DECODE_MMA_HEADS = 8  # attention_decode.cu DECODE_MMA_HEADS: query heads a tensor-core decode block serves
_CLUSTER_MAX_SPLITS = 8  # attention_decode.cu CLUSTER_MAX_SPLITS (the portable cluster size)
# A decode split reads at least this many context tokens: shorter ones spend more on their
# prologue and on the merge (in the last split's block) than the parallelism gains. By kernel:
# the tensor-core one gets through a split's tokens faster, so shorter splits pay there.
MIN_TOKENS_PER_SPLIT = {"mma": 64, "simt": 128}


def _check_cache(kv: object, heads: HeadLayout) -> CudaKvCache:
    if not isinstance(kv, CudaKvCache):
        raise ValueError(f"kv: expected a CudaKvCache, got {type(kv).__name__}")
    spec = kv.spec
    if spec.num_kv_heads != heads.num_kv_heads or spec.head_dim != heads.head_dim:
        raise ValueError(
            f"kv: cache has {spec.num_kv_heads} KV heads of {spec.head_dim}, heads say "
            f"{heads.num_kv_heads} of {heads.head_dim}"
        )
    if spec.dtype not in KV_DTYPES:
        raise ValueError(f"kv: dtype {spec.dtype.value} is not supported ({', '.join(d.value for d in KV_DTYPES)})")
    return kv


def _check_metadata(meta: AttentionMetadata) -> None:
    checks.at_least_rows(meta.query_start_loc, "meta.query_start_loc", meta.num_seqs + 1)
    checks.at_least_rows(meta.seq_lens, "meta.seq_lens", meta.num_seqs)
    checks.at_least_rows(meta.block_tables, "meta.block_tables", meta.num_seqs)
    checks.rank(meta.block_tables, "meta.block_tables", 2)
    for name, value in (
        ("positions", meta.positions),
        ("slot_mapping", meta.slot_mapping),
        ("query_start_loc", meta.query_start_loc),
        ("seq_lens", meta.seq_lens),
        ("block_tables", meta.block_tables),
    ):
        checks.dtype(value, f"meta.{name}", (DType.I32,))
    if meta.shared_prefix is not None:
        checks.at_least_rows(meta.shared_prefix, "meta.shared_prefix", meta.num_seqs + 2)
        checks.dtype(meta.shared_prefix, "meta.shared_prefix", (DType.I32,))


@dataclass(frozen=True, slots=True)
class RopeTargets:
    """What a GEMV with the rope epilogue needs besides its product: the step's positions and
    slots, the rotation table and this layer's cache planes (checked by `rope_targets`)."""

    positions: int
    slot_mapping: int
    table: CudaTensor
    k_plane: int
    v_plane: int
    heads: HeadLayout
    block_size: int


def rope_targets(
    meta: AttentionMetadata, rope_table: CudaTensor, kv: object, layer: int, heads: HeadLayout, q_out: CudaTensor
) -> RopeTargets | None:
    """The rope epilogue's arguments for a one-token step with full-width rotation into a bf16
    cache, else None (the caller then runs the projection and `rope_and_cache`, which check and
    report)."""
    if meta.num_tokens != 1 or not isinstance(kv, CudaKvCache) or q_out.dtype is not DType.BF16:
        return None
    if kv.spec.dtype is not DType.BF16:
        return None
    if (
        heads.head_dim % 2
        or rope_table.dtype not in (DType.F32, DType.BF16)
        or rope_table.shape[1:] != (heads.head_dim,)
    ):
        return None
    cache = _check_cache(kv, heads)
    _check_metadata(meta)
    checks.at_least_rows(q_out, "q_out", 1)
    if q_out.shape[1:] != (heads.q_size,):
        raise ValueError(f"q_out: width {q_out.shape[1:]} is not Hq * D = {heads.q_size}")
    return RopeTargets(
        positions=checks.address(meta.positions, "meta.positions"),
        slot_mapping=checks.address(meta.slot_mapping, "meta.slot_mapping"),
        table=rope_table,
        k_plane=cache.key_plane(layer),
        v_plane=cache.value_plane(layer),
        heads=heads,
        block_size=cache.spec.block_size,
    )


def rope_blocks_per_token(num_tokens: int, total_heads: int, num_sms: int) -> int:
    """Blocks of rope_and_cache per token, each taking groups of _ROPE_WARPS heads in turn: a
    block per group while the grid is small (decode: a token's heads spread over the SMs), fewer
    as the tokens alone fill the GPU (8 blocks an SM), down to one per token at prefill sizes, so
    that each block's RMS of the token's row (rms_source) is taken once per token, not per group."""
    groups = -(-total_heads // _ROPE_WARPS)
    return max(1, min(groups, -(-8 * num_sms // num_tokens)))


def rope_and_cache(
    rt: CudaRuntime,
    qkv: CudaTensor,
    meta: AttentionMetadata,
    rope_table: CudaTensor | None,
    kv: object,
    layer: int,
    heads: HeadLayout,
    q_out: CudaTensor,
    q_norm: CudaTensor | None,
    k_norm: CudaTensor | None,
    norm_eps: float,
    rms_source: CudaTensor | None = None,
    gated: bool = False,
) -> None:
    """rope_and_cache (the port's); with `rms_source` ([N, H] bf16, H a multiple of 8) each
    token's q, k and v are first scaled by 1 / sqrt(mean(rms_source^2) + norm_eps): qkv is then
    the product of that unnormalised input with a projection its norm weight was folded into.
    `gated`: qkv holds a gate head per q head after the q heads, which q_out keeps after them
    (q_out [N, 2 Hq D]). `rope_table` None: nothing rotates."""
    cache = _check_cache(kv, heads)
    _check_metadata(meta)
    num_tokens = meta.num_tokens
    head_dim = heads.head_dim
    if head_dim > 256:
        raise ValueError(f"heads.head_dim: {head_dim} is over the kernel's 256")
    checks.dtype(qkv, "qkv", (DType.BF16,))
    checks.dtype(q_out, "q_out", (DType.BF16,))
    checks.at_least_rows(qkv, "qkv", num_tokens)
    q_width = heads.q_size * (2 if gated else 1)
    if qkv.shape[1:] != (q_width + 2 * heads.kv_size,):
        raise ValueError(f"qkv: width {qkv.shape[1:]} is not q (+ gates) + k + v = {q_width + 2 * heads.kv_size}")
    checks.at_least_rows(q_out, "q_out", num_tokens)
    if q_out.shape[1:] != (q_width,):
        raise ValueError(f"q_out: width {q_out.shape[1:]} is not {q_width}")
    if rope_table is None:
        rope_table = CudaTensor(rt.workspace("rope_none", 16), (1, 0), DType.F32, rt)
    checks.rank(rope_table, "rope_table", 2)
    checks.dtype(rope_table, "rope_table", (DType.F32, DType.BF16))
    rotary_dim = rope_table.shape[1]
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rope_table: {rotary_dim} columns must be even and <= head_dim {head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: give both or neither")
    norm_dtype = DType.BF16
    if q_norm is not None and k_norm is not None:
        checks.shape(q_norm, "q_norm", (head_dim,))
        checks.shape(k_norm, "k_norm", (head_dim,))
        checks.dtype(q_norm, "q_norm", (DType.BF16, DType.F32))
        if k_norm.dtype is not q_norm.dtype:
            raise ValueError("k_norm: dtype differs from q_norm's")
        norm_dtype = q_norm.dtype
    if rms_source is not None:
        checks.dtype(rms_source, "rms_source", (DType.BF16,))
        checks.rank(rms_source, "rms_source", 2)
        checks.at_least_rows(rms_source, "rms_source", num_tokens)
        if rms_source.shape[1] % 8:
            raise ValueError(f"rms_source: width {rms_source.shape[1]} is not a multiple of 8")
    if num_tokens == 0:
        return
    symbol = f"rope_and_cache_{checks.type_suffix(rope_table.dtype)}_{checks.type_suffix(norm_dtype)}"
    scales = ()
    if cache.spec.dtype is DType.FP8_E4M3:
        k_scale, v_scale = cache.spec.layer_scales(layer)
        symbol += "_fp8"
        scales = (np.float32(1.0 / k_scale), np.float32(1.0 / v_scale))
    gate_heads = heads.num_q_heads if gated else 0
    total_heads = heads.num_q_heads + gate_heads + 2 * heads.num_kv_heads
    rt.launch(
        "rope_cache",
        symbol,
        (num_tokens, rope_blocks_per_token(num_tokens, total_heads, rt.num_sms)),
        _ROPE_WARPS * 32,
        qkv.address,
        checks.address(meta.positions, "meta.positions"),
        checks.address(meta.slot_mapping, "meta.slot_mapping"),
        rope_table.address,
        np.int32(rope_table.shape[0]),
        cache.key_plane(layer),
        cache.value_plane(layer),
        q_out.address,
        q_norm.address if q_norm is not None else 0,
        k_norm.address if k_norm is not None else 0,
        np.float32(norm_eps),
        np.int32(heads.num_q_heads),
        np.int32(heads.num_kv_heads),
        np.int32(head_dim),
        np.int32(rotary_dim),
        np.int32(cache.spec.block_size),
        rms_source.address if rms_source is not None else 0,
        np.int32(rms_source.shape[1] if rms_source is not None else 0),
        np.int32(gate_heads),
        *scales,
    )


@dataclass(frozen=True, slots=True)
class AttentionExtras:
    """What the `_x` kernels add (kernels/common/attention_extras.cuh): per-head sink logits, a
    soft-cap of the scores, a sigmoid gate on the output (q rows then carry the gates)."""

    sinks: CudaTensor | None = None  # [Hq] f32
    softcap: float | None = None
    gated: bool = False

    def arguments(self, heads: HeadLayout) -> tuple:
        q_stride = heads.q_size * (2 if self.gated else 1)
        softcap_log2 = 0.0 if self.softcap is None else self.softcap * math.log2(math.e)
        sinks = self.sinks.address if self.sinks is not None else 0
        return (np.int32(q_stride), np.float32(softcap_log2), sinks, np.int32(self.gated))


def attention(
    rt: CudaRuntime,
    q: CudaTensor,
    kv: object,
    layer: int,
    meta: AttentionMetadata,
    heads: HeadLayout,
    scale: float,
    out: CudaTensor,
    sliding_window: int | None,
    extras: AttentionExtras | None = None,
) -> None:
    """Paged attention of the step's queries (see the kernels' headers); with `extras` the `_x`
    kernels (mma.sync prefill, tensor-core decode: an FP8 cache or a block size the decode kernel
    cannot tile then raises ValueError naming the way out)."""
    cache = _check_cache(kv, heads)
    _check_metadata(meta)
    head_dim = heads.head_dim
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"heads.head_dim: {head_dim} has no attention kernel (have {SUPPORTED_HEAD_DIMS})")
    if heads.num_q_heads % heads.num_kv_heads:
        raise ValueError(f"heads: {heads.num_q_heads} query heads do not divide over {heads.num_kv_heads} KV heads")
    gated = extras is not None and extras.gated
    for name, value, width in (("q", q, heads.q_size * (2 if gated else 1)), ("out", out, heads.q_size)):
        checks.dtype(value, name, (DType.BF16,))
        checks.at_least_rows(value, name, meta.num_tokens)
        if value.shape[1:] != (width,):
            raise ValueError(f"{name}: width {value.shape[1:]} is not {width}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window: {sliding_window} must be positive (or None)")
    if meta.num_seqs == 0 or meta.num_tokens == 0:
        return
    common = (
        checks.address(meta.query_start_loc, "meta.query_start_loc"),
        checks.address(meta.seq_lens, "meta.seq_lens"),
        checks.address(meta.block_tables, "meta.block_tables"),
        np.int32(meta.block_tables.shape[1]),
    )
    # An FP8 cache's K scale joins the softmax scale; its V scale goes to the kernels.
    kv_fp8 = cache.spec.dtype is DType.FP8_E4M3
    k_scale, v_scale = cache.spec.layer_scales(layer)
    scale_log2 = np.float32(scale * k_scale * math.log2(math.e))
    window = np.int32(sliding_window or 0)
    planes = (cache.key_plane(layer), cache.value_plane(layer))
    block_size = cache.spec.block_size
    extra_arguments = extras.arguments(heads) if extras is not None else None
    if meta.max_query_len > 1:
        _prefill(rt, q, out, planes, common, meta, heads, block_size, scale_log2, window, kv_fp8, v_scale,
                 extra_arguments)
        if meta.num_seqs == 1:
            # A lone sequence's chunk: no single-token row for the decode kernel, whose blocks would
            # all leave at once. (A request's prefill step: its launch and ~25 us of host work a layer.)
            return
    _decode(rt, q, out, planes, common, meta, heads, block_size, scale_log2, window, kv_fp8, v_scale,
            extra_arguments)


@dataclass(frozen=True, slots=True)
class PrefillKernel:
    """The prefill attention kernel to launch and its launch shape."""

    symbol: str
    rows: int  # query rows (token x head-in-group) per tile
    threads: int
    shared_bytes: int
    module: str = "attention_prefill"


def wgmma_prefill_shared_bytes(head_dim: int, keys_per_tile: int, kv_fp8: bool = False) -> int:
    """Shared memory of `attention_prefill_wgmma_d{head_dim}_n{keys_per_tile}` (WgmmaTile): Q
    [128 rows] plus two stages of K and V tiles, bf16, plus 1 KB to align the swizzle atoms. The
    `_fp8` kernel keeps one stage of the bf16 K and V tiles and two of the cached E4M3 bytes (a byte
    an element), which comes to the same bytes."""
    if kv_fp8:
        kv_bytes = 2 * keys_per_tile * head_dim * 2 + 2 * 2 * keys_per_tile * head_dim
    else:
        kv_bytes = 2 * 2 * keys_per_tile * head_dim * 2
    return _WGMMA_ROWS * head_dim * 2 + kv_bytes + 1024


def prefill_kernel(rt: CudaRuntime, head_dim: int, kv_fp8: bool = False, extras: bool = False) -> PrefillKernel:
    """The wgmma kernel where the loaded module has it (kernels/sm90 on Hopper), the device gives a
    block its shared memory and `rt.features.wgmma_attention` is on; else the mma.sync kernel.
    `kv_fp8`: the `_fp8` twin, for a cache of E4M3 bytes (same launch shape, one more argument).
    `extras`: the `_x` twin (sinks, soft-cap, gate; four more arguments)."""
    suffix = "_fp8" if kv_fp8 else ""
    keys_per_tile = WGMMA_KEYS_PER_TILE.get(head_dim)
    if keys_per_tile is not None and rt.features.wgmma_attention:
        symbol = f"attention_prefill_wgmma_d{head_dim}_n{keys_per_tile}{suffix}{'_x' if extras else ''}"
        module = WGMMA_X_MODULE if extras or head_dim == 256 else "attention_prefill"
        shared_bytes = wgmma_prefill_shared_bytes(head_dim, keys_per_tile, kv_fp8)
        if shared_bytes <= rt.max_shared_optin and rt.kernels.provides(module, symbol):
            return PrefillKernel(symbol, _WGMMA_ROWS, _WGMMA_THREADS, shared_bytes, module)
    rows, _, shared_bytes = prefill_tile(head_dim, rt.max_shared_optin, kv_fp8)
    symbol = f"attention_prefill_d{head_dim}_m{rows}{suffix}{'_x' if extras else ''}"
    return PrefillKernel(symbol, rows, rows // 16 * 32, shared_bytes)


def prefill_tile(head_dim: int, max_shared_bytes: int, kv_fp8: bool = False) -> tuple[int, int, int]:
    """(rows per tile, K/V stages, shared bytes) of the prefill kernel variant to launch: 128-row
    tiles where the device gives a block enough shared memory, else 64 (attention_prefill.cu).
    bf16: Q [rows] and `stages` of K and V tiles [64 keys], all of padded rows (D + 8) x 2 bytes.
    FP8 (`kv_fp8`): Q and one stage of those tiles, plus, with two stages, two of the cached E4M3
    bytes [64 keys][D] (the one-stage kernel loads them through registers)."""
    stride = head_dim + 8  # padded rows, as the kernel lays them out
    stages = 2 if head_dim <= 128 else 1
    for rows in (128, 64):
        if kv_fp8:
            staging = 2 * 2 * _PREFILL_BLOCK_N * head_dim if stages == 2 else 0
            shared_bytes = (rows + 2 * _PREFILL_BLOCK_N) * stride * 2 + staging
        else:
            shared_bytes = (rows + stages * 2 * _PREFILL_BLOCK_N) * stride * 2
        if (head_dim, rows) in _PREFILL_VARIANTS and shared_bytes <= max_shared_bytes:
            return rows, stages, shared_bytes
    raise ValueError(f"heads.head_dim: {head_dim} needs more shared memory than the device has")


def _prefill(
    rt, q, out, planes, common, meta, heads, block_size, scale_log2, window, kv_fp8=False, v_scale=1.0,
    extra_arguments=None,
) -> None:
    """Launches the prefill kernel; with `kv_fp8` the planes hold E4M3 bytes, `scale_log2` has the
    K scale folded in, and the `_fp8` kernel multiplies its output by `v_scale`; with
    `extra_arguments` (AttentionExtras.arguments) the `_x` kernel."""
    group = heads.num_q_heads // heads.num_kv_heads
    kernel = prefill_kernel(rt, heads.head_dim, kv_fp8, extra_arguments is not None)
    num_tiles = (meta.num_tokens * group) // kernel.rows + meta.num_seqs
    query_start_loc, seq_lens, block_tables, table_stride = common
    fp8_arguments = (np.float32(v_scale),) if kv_fp8 else ()
    splits = prefill_split_count(rt.num_sms, meta.num_tokens, meta.max_seq_len, group, heads.num_kv_heads)
    split_symbol = f"{kernel.symbol}_split"
    plain_wgmma = not kv_fp8 and extra_arguments is None and kernel.symbol.startswith("attention_prefill_wgmma")
    if splits > 1 and rt.features.prefill_split and plain_wgmma and rt.kernels.provides(WGMMA_X_MODULE, split_symbol):
        slots = meta.num_tokens * heads.num_q_heads * splits
        split_arguments = (
            rt.workspace("attention_prefill_partial_out", slots * heads.head_dim * 4),
            rt.workspace("attention_prefill_partial_lse", slots * 4),
            rt.counters("attention_prefill_split_counters", num_tiles * heads.num_kv_heads),
            np.int32(splits),
        )
        kernel = replace(kernel, symbol=split_symbol, module=WGMMA_X_MODULE)
    else:
        splits, split_arguments = 1, ()
    rt.launch(
        kernel.module,
        kernel.symbol,
        (num_tiles, heads.num_kv_heads, splits),
        kernel.threads,
        q.address,
        planes[0],
        planes[1],
        out.address,
        query_start_loc,
        seq_lens,
        block_tables,
        table_stride,
        np.int32(meta.num_seqs),
        np.int32(heads.num_q_heads),
        np.int32(heads.num_kv_heads),
        np.int32(block_size),
        scale_log2,
        window,
        np.int32(1),  # single-token queries go to the decode kernel, launched next
        *fp8_arguments,
        *(extra_arguments or ()),
        *split_arguments,
        shared_bytes=kernel.shared_bytes,
    )


# The prefill kernel splits a step's contexts (its `_split` twin) only for steps of at most this
# many tokens (the partial outputs take tokens x Hq x splits x D floats), into at most
# PREFILL_MAX_SPLITS parts of at least PREFILL_MIN_SPLIT_KEYS keys each.
PREFILL_SPLIT_MAX_TOKENS = 512
PREFILL_MAX_SPLITS = 4
PREFILL_MIN_SPLIT_KEYS = 512


# A step of one sequence over at most this many keys launches the prefill kernel alone (no decode
# rows: `attention` returns after it), unsplit (`prefill_split_count` is 1 below two parts'
# keys), on a grid sized by its token count: its varlen tiles find their rows in the device's
# query starts, and those past the sequence's leave at once. A graph captured over a token
# bucket then serves every such step of up to as many tokens (`Capabilities.whole_prompt_keys`).
WHOLE_PROMPT_MAX_KEYS = 2 * PREFILL_MIN_SPLIT_KEYS - 1


def prefill_split_count(num_sms: int, num_tokens: int, max_seq_len: int, group: int, num_kv_heads: int) -> int:
    """Parts of the context per (128-row tile, KV head) for the prefill kernel: a few query
    tokens over long contexts (a chat turn after a cached history, chunks beside decodes) give
    a few tiles that each walk the whole context on one SM, while the others idle. Splitting
    fills about two blocks an SM, each part reading at least PREFILL_MIN_SPLIT_KEYS keys; 1
    for larger steps or short contexts."""
    if num_tokens > PREFILL_SPLIT_MAX_TOKENS:
        return 1
    working_blocks = (num_tokens * group // 128 + 1) * num_kv_heads  # the tiles' blocks, roughly
    return max(1, min(PREFILL_MAX_SPLITS, max_seq_len // PREFILL_MIN_SPLIT_KEYS, 2 * num_sms // working_blocks))


def decode_split_count(
    num_sms: int,
    num_blocks_per_split: int,
    max_seq_len: int,
    blocks_per_sm: int = 2,
    min_tokens: int = 128,
    waves: int = 2,
) -> int:
    """Splits of the context per (sequence, head group): as many as fit `waves` waves of the
    blocks the GPU holds at once (`blocks_per_sm` per SM), each split reading at least
    `min_tokens` tokens; none once the unsplit blocks fill a wave. The tensor-core kernel takes
    one wave: a second wave of short splits costs more than it hides (H200, Llama-3.1-8B batch
    16: 4759 us a step with 2 splits in one wave against 5063 with 5 splits in 2.4 waves); the
    SIMT kernel, bound by issue, keeps two."""
    slots = blocks_per_sm * num_sms
    if num_blocks_per_split >= slots:
        return 1
    wanted = waves * slots // num_blocks_per_split
    by_length = max(1, -(-max_seq_len // min_tokens))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def decode_mma_shape(
    head_dim: int, num_blocks: int, num_sms: int, max_shared_per_sm: int, kv_bytes: int = 2,
    max_shared_per_block: int | None = None,
) -> tuple[int, int, int]:
    """(warps, stages, blocks per SM) of the tensor-core decode kernel for `num_blocks` blocks
    before splitting (see DECODE_MMA_SHAPES; DECODE_MMA_SHAPES_FP8 for 1-byte K/V), of the shapes
    whose shared memory a block may have (`max_shared_per_block`: sm_120 gives 99 KB, which
    head dim 128's (8, 2) outgrows)."""
    table = DECODE_MMA_SHAPES_FP8 if kv_bytes == 1 else DECODE_MMA_SHAPES
    fitting = [
        (warps, stages)
        for warps, stages in table[head_dim]
        if max_shared_per_block is None
        or decode_mma_shared_bytes(head_dim, warps, stages, kv_bytes) <= max_shared_per_block
    ]
    if not fitting:
        raise ValueError(f"heads.head_dim: {head_dim}: no decode attention shape fits {max_shared_per_block} bytes of "
                         "shared memory a block; set ATLAS_CUDA_DISABLE=mma_decode")
    shapes = [
        (
            warps,
            stages,
            max(1, max_shared_per_sm // (decode_mma_shared_bytes(head_dim, warps, stages, kv_bytes) + 1024)),
        )
        for warps, stages in fitting
    ]
    holding = [shape for shape in shapes if shape[2] * num_sms >= num_blocks]
    if not holding:
        return shapes[0]
    snug = [shape for shape in holding if shape[2] * num_sms < 2 * num_blocks]
    return min(snug or holding, key=lambda shape: shape[2])


def decode_heads_per_block(group: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Query heads of a GQA group that one block of the SIMT decode kernel serves (from one read
    of their KV head): the smallest power of two >= min(G, 8); at most 2 while the batch's KV
    heads are a quarter of the SMs or fewer, where a block's serial work (its heads one after
    another, per token) is the step's latency. On an H200, Llama-3.1-8B (G = 4) decode steps at a 512-token context: batch 1
    3939-3974 us with 2 heads per block against 4024 with 4; batch 64 6037 with 4 against 6490
    with 2 (each KV head then read twice, and the kernel is issue-bound there)."""
    heads = next(h for h in (1, 2, 4, 8) if h >= min(group, 8))
    return min(heads, 2) if num_seqs * num_kv_heads <= num_sms // 4 else heads


def decode_mma_shared_bytes(head_dim: int, warps: int, stages: int, kv_bytes: int = 2) -> int:
    """Shared memory of attention_decode_mma_*: each warp's ring of K and V tiles (16 rows of
    `kv_bytes`-byte elements), which the block's merge reuses once the tiles are done: each
    warp's maxima, sums and outputs for 8 heads, then `merge_cluster`'s log2-sum-exps and
    outputs (f32)."""
    ring = warps * stages * 2 * 16 * head_dim * kv_bytes
    merge = 4 * (warps * _DECODE_MMA_HEADS * (2 + head_dim) + _DECODE_MMA_HEADS * (1 + head_dim))
    return max(ring, merge)


def decode_cluster(rt: CudaRuntime, splits: int, cascade: bool) -> tuple[int, int, int]:
    """The cluster shape of a tensor-core decode launch of `splits` splits: (1, 1, splits) where
    the splits merge through distributed shared memory (`cluster_merge`, 2..8 splits, no
    cascade; attention_decode.cu `merge_cluster`), else (1, 1, 1)."""
    if rt.features.cluster_merge and not cascade and 1 < splits <= _CLUSTER_MAX_SPLITS:
        return (1, 1, splits)
    return (1, 1, 1)


def _decode(
    rt, q, out, planes, common, meta, heads, block_size, scale_log2, window, kv_fp8, v_scale, extra_arguments=None
) -> None:
    group = heads.num_q_heads // heads.num_kv_heads
    # Tensor cores: up to 8 query heads (the mma's n) per block, whatever the batch; a 16-token
    # tile's rows lie in one page (two at block size 8).
    mma = rt.features.mma_decode and (block_size == 8 or block_size % 16 == 0)
    if kv_fp8 and not mma:
        raise ValueError(
            "kv: an FP8 cache is read only by the tensor-core decode kernel (block size 8 or a multiple of 16, "
            "and mma_decode not in ATLAS_CUDA_DISABLE); use --kv-cache-dtype bf16"
        )
    if extra_arguments is not None and not mma:
        raise ValueError(
            "layer: sinks, soft-capping and gated outputs are decoded only by the tensor-core decode kernel "
            "(--block-size 8 or a multiple of 16, and mma_decode not in ATLAS_CUDA_DISABLE)"
        )
    if mma:
        heads_per_block = 8
    else:
        num_seqs = 1 if rt.features.batch_invariant else meta.num_seqs
        heads_per_block = decode_heads_per_block(group, num_seqs, heads.num_kv_heads, rt.num_sms)
    head_groups = -(-group // heads_per_block)
    num_blocks = meta.num_seqs * heads.num_kv_heads * head_groups
    # Batch invariant: the warps (a split's tiles go round them) and the split count (each row
    # then splits its own context as it would alone) of one sequence, whatever the step's rows.
    shape_blocks = heads.num_kv_heads * head_groups if rt.features.batch_invariant else num_blocks
    if mma:
        kind, waves = "mma", 1
        kv_bytes = 1 if kv_fp8 else 2
        warps, stages, blocks_per_sm = decode_mma_shape(
            heads.head_dim, shape_blocks, rt.num_sms, rt.max_shared_per_sm, kv_bytes, rt.max_shared_optin
        )
        symbol, threads = f"attention_decode_mma_d{heads.head_dim}_w{warps}_s{stages}", warps * 32
        symbol += "_fp8" if kv_fp8 else ""
        symbol += "_x" if extra_arguments is not None else ""
        shared_bytes = decode_mma_shared_bytes(heads.head_dim, warps, stages, kv_bytes)
    else:
        kind, waves = "simt", 2
        symbol, threads = f"attention_decode_d{heads.head_dim}_h{heads_per_block}", _DECODE_THREADS
        shared_bytes, blocks_per_sm = 0, 2
    # a tensor-core split gives each warp at least one 16-token tile: Qwen3-30B-A3B's 4 KV heads
    # at batch 1 (H200, 512 tokens) step in 2959 us with 4 splits of 128 against 3012 with 8 of 64
    min_tokens = max(MIN_TOKENS_PER_SPLIT[kind], 16 * warps) if mma else MIN_TOKENS_PER_SPLIT[kind]
    splits = decode_split_count(rt.num_sms, shape_blocks, meta.max_seq_len, blocks_per_sm, min_tokens, waves)
    partial_out = partial_lse = counters = 0
    if splits > 1:
        slots = meta.num_seqs * heads.num_q_heads * splits
        partial_out = rt.workspace("attention_partial_out", slots * heads.head_dim * 4)
        partial_lse = rt.workspace("attention_partial_lse", slots * 4)
        counters = rt.counters("attention_split_counters", num_blocks)
    query_start_loc, seq_lens, block_tables, table_stride = common
    cascade = ()
    if (
        mma
        and _cascades(rt, meta, window)
        and cascade_shared_bytes(heads.head_dim, kv_fp8) <= rt.max_shared_optin
    ):
        cascade = _cascade_prefix(rt, q, planes, common, meta, heads, block_size, scale_log2, kv_fp8,
                                  extra_arguments)
        symbol += "_cascade"
    cluster = decode_cluster(rt, splits, bool(cascade)) if mma else (1, 1, 1)
    rt.launch(
        "attention_decode",
        symbol,
        (meta.num_seqs, heads.num_kv_heads * head_groups, splits),
        threads,
        q.address,
        planes[0],
        planes[1],
        out.address,
        partial_out,
        partial_lse,
        counters,
        query_start_loc,
        seq_lens,
        block_tables,
        table_stride,
        np.int32(heads.num_q_heads),
        np.int32(heads.num_kv_heads),
        np.int32(block_size),
        scale_log2,
        window,
        np.int32(splits),
        np.int32(min_tokens),
        *((np.float32(v_scale),) if kv_fp8 else ()),
        *(extra_arguments or ()),
        *cascade,
        shared_bytes=shared_bytes,
        cluster=cluster,
    )


# The cascade's prefix kernel (attention_decode.cu, "Cascade attention"): 64 query rows a block,
# 4 warps, the prefill kernel's shared-memory layout (Q and K/V tiles of 64 keys, rows of D + 8).
_CASCADE_ROWS = 64
_CASCADE_THREADS = 128
_CASCADE_MAX_PARTS = 16


def _cascades(rt: CudaRuntime, meta: AttentionMetadata, window: np.int32) -> bool:
    """Whether this step's decode rows read their shared prefix once (CudaFeatures.cascade_attention)."""
    return (
        meta.shared_prefix is not None
        and meta.shared_prefix_len > 0
        and rt.features.cascade_attention
        and not rt.features.batch_invariant
        and not window
    )


def cascade_shared_bytes(head_dim: int, kv_fp8: bool = False) -> int:
    """Shared memory of attention_cascade_d{head_dim}[_fp8]: Q [64 rows] and two stages of K and
    V tiles of 64 keys (one at head dim 256 and for an FP8 cache, whose bytes are converted into
    them), rows of D + 8 bf16."""
    stages = 2 if head_dim <= 128 and not kv_fp8 else 1
    return (_CASCADE_ROWS + stages * 2 * _PREFILL_BLOCK_N) * (head_dim + 8) * 2


def cascade_parts(num_sms: int, num_seqs: int, group: int, num_kv_heads: int) -> int:
    """Pieces of the prefix (grid z of the prefix kernel): enough that its blocks (64-row tiles
    x KV heads x pieces) fill two an SM; the kernel uses fewer on a short prefix (pieces of at
    least 256 keys)."""
    blocks = -(-num_seqs * group // _CASCADE_ROWS) * num_kv_heads
    return max(1, min(_CASCADE_MAX_PARTS, -(-2 * num_sms // blocks)))


def _cascade_prefix(rt, q, planes, common, meta, heads, block_size, scale_log2, kv_fp8=False,
                    extra_arguments=None) -> tuple:
    """Launch the prefix kernel over the step's sharing rows; the `_cascade` decode kernel's
    extra arguments. With `kv_fp8` the `_fp8` kernel (scale_log2 has the K scale folded in; the
    pieces are of stored V values, which the decode kernel scales); with `extra_arguments`
    (AttentionExtras.arguments) the `_x` kernel, which takes the q stride and the soft-cap (the
    sinks and the gate are the decode kernel's)."""
    group = heads.num_q_heads // heads.num_kv_heads
    parts = cascade_parts(rt.num_sms, meta.num_seqs, group, heads.num_kv_heads)
    slots = meta.num_seqs * heads.num_q_heads * parts
    cascade_out = rt.workspace("attention_cascade_out", slots * heads.head_dim * 4)
    cascade_lse = rt.workspace("attention_cascade_lse", slots * 4)
    shared_prefix = checks.address(meta.shared_prefix, "meta.shared_prefix")
    query_start_loc, _, block_tables, table_stride = common
    rt.launch(
        "attention_decode",
        f"attention_cascade_d{heads.head_dim}{'_fp8' if kv_fp8 else ''}{'_x' if extra_arguments else ''}",
        (-(-meta.num_seqs * group // _CASCADE_ROWS), heads.num_kv_heads, parts),
        _CASCADE_THREADS,
        q.address,
        planes[0],
        planes[1],
        cascade_out,
        cascade_lse,
        query_start_loc,
        shared_prefix,
        block_tables,
        table_stride,
        np.int32(meta.num_seqs),
        np.int32(heads.num_q_heads),
        np.int32(heads.num_kv_heads),
        np.int32(block_size),
        scale_log2,
        *(extra_arguments[:2] if extra_arguments is not None else ()),
        shared_bytes=cascade_shared_bytes(heads.head_dim, kv_fp8),
    )
    return (shared_prefix, cascade_out, cascade_lse, np.int32(parts))

