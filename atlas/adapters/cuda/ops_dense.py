"""Row-wise and dense ops: embedding, gathers, RMSNorm, gated activations, linear."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.cublaslt import WORKSPACE_BYTES, CublasLtGemm
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.gemm_tuning import GemmTuningStore, TuningStats
from atlas.adapters.cuda.ops_attention import RopeTargets
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.adapters.cuda.tma import TensorMap, bf16_rows_map
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import Activation

_FLOAT_TYPES = (DType.BF16, DType.F32)
# At most this many token rows go through the GEMV kernel; more go to cuBLASLt, or up to
# SKINNY_MAX_TOKENS to the skinny tensor-core GEMM (`gemm_skinny_*`, gemv.cu) where the
# `skinny_gemm` feature is on (off by default; see CudaFeatures).
GEMV_MAX_TOKENS = 8
SKINNY_MAX_TOKENS = 64
# The GEMV takes the RMSNorm of its input rows itself (every block re-reading them) up to this
# width where the norm is not folded (below FOLD_NORM_MIN_WIDTH, or a qkv with the RoPE
# epilogue); wider rows go through the wide tensor-core GEMV shapes at 2..8 token rows. Measured
# on an H200 at one token row: SmolLM2-135M (576) 16 us faster per step with the norm inside than
# with the norm kernel, Llama-3.1-8B (4096) 770 us slower (each of ~9000 blocks per layer spends an
# L2 round trip and a block reduction first).
NORM_IN_GEMV_MAX_WIDTH = 2048
# Rows at least this wide have the norm weight folded into the projection (`fold_rmsnorm`), and
# the GEMV (one row, or 2..8 on the tensor cores) scales its sums by each row's inverse RMS after
# the product, which it sums beside them: no block reads x twice. On an H200 at one token row:
# Llama-3.1-8B (4096) 80 us a step faster than the norm kernel; at 2048 (a TIMELINE_PATCH of the
# width bound, one call) Qwen3-30B-A3B 2,583 -> 2,479-2,489 us a step (its qkv 7.9 -> 6.0 us of
# wall a layer against the norm inside) and Qwen3-Next-36l 2,502 -> 2,436 (docs/lab/cuda-runs.md).
FOLD_NORM_MIN_WIDTH = 2048
# Rows wider than NORM_IN_GEMV_MAX_WIDTH (big models: their norms are folded) take the tensor-core
# GEMV for 2..GEMV_MAX_TOKENS token rows only on devices with less peak bandwidth per SM than
# this; past it cuBLASLt's kernels read the weights faster. Llama-3.1-8B, k = 4 verify step
# over a decode step and batch 2 decode: H100 SXM (25 GB/s an SM) GEMV 1.124x / 5.73 ms against
# cuBLASLt 1.140x / 5.82 ms; H200 (37 GB/s an SM) GEMV 1.174x / 4.57 ms against cuBLASLt
# 1.139x / 4.40 ms (docs/lab/speculative-plan.md).
WIDE_GEMV_MAX_BANDWIDTH_PER_SM = 30e9
_GEMV_WARPS = 4
# The tensor-core GEMV's two shapes (gemv.cu): warps a block for rows up to NORM_IN_GEMV_MAX_WIDTH
# wide (`gemv_mma_*`) and past it (`gemv_mma_wide_*`, `gemv_mma_folded_*`).
_GEMV_MMA_WARPS = 8
_GEMV_MMA_WIDE_WARPS = 16
# gemm_skinny_<what>_<width> (gemv.cu): one consumer warpgroup and a producer warp per block;
# tiles of `width` weight rows; K split over clusters of up to 4 blocks.
_SKINNY_THREADS = 160
SKINNY_WIDTHS = (64, 96, 128, 144, 160, 192, 224, 256)
_SKINNY_SPLITS = (2, 4)
_SKINNY_STAGE_K = 64
_ACTIVATION_NAMES = {Activation.SILU: "silu", Activation.GELU_TANH: "gelu_tanh"}
_MAX_GRID_Y = 65535  # act_mul_rms's token rows are blockIdx.y


def _mma_symbol(what: str, inner: int) -> tuple[str, int]:
    """The tensor-core GEMV kernel of `what` for rows of `inner` elements and its threads a block."""
    if inner > NORM_IN_GEMV_MAX_WIDTH:
        return f"gemv_mma_wide_{what}", _GEMV_MMA_WIDE_WARPS * 32
    return f"gemv_mma_{what}", _GEMV_MMA_WARPS * 32


def gather_rows(rt: CudaRuntime, source: CudaTensor, indices: CudaTensor, out: CudaTensor, what: str) -> None:
    """out[r] = source[indices[r]] for any element type (an index out of range gives zeros)."""
    checks.rank(source, f"{what}: table", 2)
    checks.dtype(indices, f"{what}: indices", (DType.I32,))
    checks.rank(indices, f"{what}: indices", 1)
    checks.shape(out, f"{what}: out", (indices.shape[0], source.shape[1]))
    if out.dtype is not source.dtype:
        raise ValueError(f"{what}: out is {out.dtype.value} but the table is {source.dtype.value}")
    num_rows = indices.shape[0]
    if num_rows == 0:
        return
    row_bytes = source.shape[1] * source.dtype.itemsize
    width = next(
        w
        for w in (16, 4, 1)
        if row_bytes % w == 0 and checks.aligned(source.address, w) and checks.aligned(out.address, w)
    )
    symbol = f"gather_rows_v{width}"
    threads = int(min(256, max(32, row_bytes // width)))
    rt.launch(
        "elementwise",
        symbol,
        (num_rows,),
        threads,
        out.address,
        source.address,
        indices.address,
        np.int32(source.shape[0]),
        np.int64(row_bytes),
    )


def rmsnorm(
    rt: CudaRuntime,
    x: CudaTensor,
    residual: CudaTensor | None,
    weight: CudaTensor,
    eps: float,
    out: CudaTensor,
) -> None:
    """rmsnorm, or residual += x then rmsnorm(residual) when `residual` is given."""
    checks.rank(x, "x", 2)
    checks.dtype(x, "x", _FLOAT_TYPES)
    checks.dtype(weight, "weight", _FLOAT_TYPES)
    num_tokens, hidden = x.shape
    checks.shape(weight, "weight", (hidden,))
    checks.shape(out, "out", x.shape)
    if out.dtype is not x.dtype:
        raise ValueError(f"out: dtype {out.dtype.value} differs from x's {x.dtype.value}")
    if residual is not None:
        checks.shape(residual, "residual", x.shape)
        if residual.dtype is not x.dtype:
            raise ValueError(f"residual: dtype {residual.dtype.value} differs from x's {x.dtype.value}")
    if num_tokens == 0:
        return
    vector = hidden % 8 == 0
    prefix = "add_rmsnorm" if residual is not None else "rmsnorm"
    symbol = (
        f"{prefix}_{checks.type_suffix(x.dtype)}_{checks.type_suffix(weight.dtype)}_{'vec8' if vector else 'scalar'}"
    )
    work_items = hidden // 8 if vector else hidden
    threads = int(min(1024, max(64, -(-work_items // 32) * 32)))
    args: tuple[object, ...]
    if residual is not None:
        args = (x.address, residual.address, weight.address, np.float32(eps), out.address, np.int32(hidden))
    else:
        args = (x.address, weight.address, np.float32(eps), out.address, np.int32(hidden))
    rt.launch("norm", symbol, (num_tokens,), threads, *args)


def act_mul(rt: CudaRuntime, x: CudaTensor, activation: Activation, out: CudaTensor) -> None:
    """out = act(x[:, :I]) * x[:, I:]."""
    checks.rank(x, "x", 2)
    checks.dtype(x, "x", _FLOAT_TYPES)
    num_tokens, width = x.shape
    if width % 2:
        raise ValueError(f"x: width {width} is not even (gate | up halves)")
    inner = width // 2
    checks.shape(out, "out", (num_tokens, inner))
    if out.dtype is not x.dtype:
        raise ValueError(f"out: dtype {out.dtype.value} differs from x's {x.dtype.value}")
    if num_tokens == 0:
        return
    vector = inner % 8 == 0
    symbol = f"act_mul_{_ACTIVATION_NAMES[activation]}_{checks.type_suffix(x.dtype)}_{'vec8' if vector else 'scalar'}"
    items = num_tokens * inner // (8 if vector else 1)
    blocks = int(min(-(-items // 256), rt.num_sms * 8))
    rt.launch("elementwise", symbol, (blocks,), 256, x.address, out.address, np.int32(num_tokens), np.int32(inner))


def act_mul_rms(
    rt: CudaRuntime, x: CudaTensor, activation: Activation, rms_source: CudaTensor, eps: float, out: CudaTensor
) -> None:
    """out = act(s x[:, :I]) * (s x[:, I:]), s each row's 1 / sqrt(mean(rms_source^2) + eps): the
    gated product of a folded norm's unnormalised input (bf16, I and H multiples of 8, checked
    by the caller). A block per (chunk of I, token); every block of a token sums its row."""
    num_tokens, width = rms_source.shape
    inner = out.shape[1]
    per_token = -(-inner // (8 * 256))
    chunks = max(1, min(per_token, -(-2 * rt.num_sms // num_tokens)))
    rt.launch(
        "elementwise",
        f"act_mul_rms_{_ACTIVATION_NAMES[activation]}_bf16_vec8",
        (chunks, num_tokens),
        256,
        x.address,
        out.address,
        rms_source.address,
        np.float32(eps),
        np.int32(inner),
        np.int32(width),
    )


def add_into(rt: CudaRuntime, delta: CudaTensor, residual: CudaTensor) -> None:
    """residual += delta (bf16)."""
    checks.dtype(delta, "delta", (DType.BF16,))
    checks.dtype(residual, "residual", (DType.BF16,))
    checks.shape(delta, "delta", residual.shape)
    count = int(np.prod(residual.shape))
    if count == 0:
        return
    blocks = int(min(-(-count // 256), rt.num_sms * 8))
    rt.launch("elementwise", "add_into_bf16", (blocks,), 256, residual.address, delta.address, np.int64(count))


def _check_linear(x: CudaTensor, weight: CudaTensor, out: CudaTensor, bias: CudaTensor | None) -> tuple[int, int, int]:
    """(tokens, output features, inner size) of out = x @ weight.T + bias, checked."""
    checks.rank(x, "x", 2)
    checks.rank(weight, "weight", 2)
    checks.dtype(x, "x", (DType.BF16,))
    checks.dtype(weight, "weight", (DType.BF16,))
    checks.dtype(out, "out", _FLOAT_TYPES)
    num_tokens, inner = x.shape
    num_rows = weight.shape[0]
    if weight.shape[1] != inner:
        raise ValueError(f"weight: shape {list(weight.shape)} does not take x of width {inner}")
    checks.shape(out, "out", (num_tokens, num_rows))
    if bias is not None:
        checks.shape(bias, "bias", (num_rows,))
        checks.dtype(bias, "bias", (DType.BF16,))
    return num_tokens, num_rows, inner


# A 4-warp block's first round of loads covers 4 x 1024 of K (gemv.cu's BATCH x STEP); up to half
# of that, 2 warps keep the same bytes in flight.
_NARROW_MAX_INNER = _GEMV_WARPS * 32 * 8 * 4 // 2


# The largest grid of 2-warp blocks `_narrow_warps` takes, in waves of 8 blocks an SM. A module
# constant so that `timeline_bench.py`'s TIMELINE_PATCH can race a wider bound without an edit
# (Qwen3-30B-A3B's qkv, 1,280 blocks, is 1.21 waves of 2-warp blocks against 2.4 of 4-warp ones;
# not measured yet).
NARROW_MAX_WAVES = 1.0


def _narrow_warps(rows: int, inner: int, blocks: int, num_sms: int) -> bool:
    """Whether a one-token SIMT GEMV of `rows` rows a block takes its 2-warp form
    (`gemv_*_r4_w2_t1`, gemv.cu's gemv_impl): K over 1024 and up to 2048, where 4 warps leave
    half their loads unused, and a grid that 2 warps bring from two waves into one (4 blocks of
    4 warps fit an SM at their ~127 registers a thread, 8 of 2 warps). On an H200 the 8B's
    o_proj at TP=2 (1,024 blocks) went from 7.4 to 3.3 us of wall time a layer; grids of many
    waves (Qwen3-30B-A3B's lm_head) gain nothing, so they keep 4 warps."""
    fits_once = 4 * num_sms < blocks <= NARROW_MAX_WAVES * 8 * num_sms
    return rows == 4 and 1024 < inner <= _NARROW_MAX_INNER and fits_once


def _rows_per_block(num_rows: int, num_sms: int) -> int:
    """Output features per block of the SIMT GEMV: more while there are still two blocks per SM
    (each lane then keeps more 16-byte loads in flight and x is reread from L1 less often)."""
    return next((r for r in (4, 2) if num_rows // r >= 2 * num_sms), 1)


def _product_args(x: CudaTensor, weight: CudaTensor, bias: CudaTensor | None, out: CudaTensor, features: int) -> tuple:
    """The arguments every gemv.cu kernel starts with: x, w, bias (or null), out, num_tokens,
    num_rows (output features), inner."""
    num_tokens, inner = x.shape
    bias_address = bias.address if bias is not None else 0
    return (
        x.address,
        weight.address,
        bias_address,
        out.address,
        np.int32(num_tokens),
        np.int32(features),
        np.int32(inner),
    )


def skinny_shared_bytes(width: int) -> int:
    """Dynamic shared memory of gemm_skinny_*_<width>: gemv.cu's SkinnyTile<width>::shared_bytes
    (a ring of up to 8 stages in 200 KB, x's [64][64] and the weight's [width][64] each, 1024
    bytes of alignment slack, two barriers per stage; the kernel traps if given less)."""
    stage = (64 + width) * _SKINNY_STAGE_K * 2
    stages = min(8, 200 * 1024 // stage)
    return 1024 + stages * stage + 16 * stages


def skinny_x_box_rows(num_tokens: int) -> int:
    """Rows of x's TMA box in gemm_skinny_*: the token rows rounded up to 8, as the kernel's
    expected bytes per stage count them. A 64-row box over 16 rows, the rest zero-filled, made the
    split products at 16 tokens up to 1.5x slower (docs/cuda-notes.md run 19)."""
    return min(64, -(-num_tokens // 8) * 8)


@dataclass(frozen=True, slots=True)
class SkinnyPlan:
    """How gemm_skinny_* covers one product: tiles of `width` weight rows, K split `splits` ways
    (a cluster of that many blocks per tile), `grid` blocks."""

    width: int
    splits: int
    tiles: int
    grid: int


def skinny_plan(
    features: int, gated: bool, inner: int, num_sms: int, cluster_blocks: Callable[[int, int], int]
) -> SkinnyPlan:
    """The plan that gives the busiest SM the fewest bytes to stream: whole tiles on persistent
    blocks (one per SM, `splits` = 1), or one wave of clusters that split K (`cluster_blocks(width,
    splits)`: blocks the GPU holds at once in clusters of `splits`). Counted per SM: the weight
    bytes, x's tile re-read from L2 at a quarter of their cost, and (split) half the fp32 partial
    sums exchanged between the cluster's blocks."""
    k_iters = -(-inner // _SKINNY_STAGE_K)
    best: tuple[float, SkinnyPlan] | None = None
    for width in SKINNY_WIDTHS:
        tiles = -(-features // (width // 2 if gated else width))
        unit_cost = width * _SKINNY_STAGE_K * 2 + 64 * _SKINNY_STAGE_K * 2 / 4
        for splits in (1, *_SKINNY_SPLITS):
            if splits == 1:
                plan = SkinnyPlan(width, 1, tiles, min(tiles, num_sms))
                cost = -(-tiles // num_sms) * k_iters * unit_cost
            elif tiles * splits <= cluster_blocks(width, splits) and k_iters >= 2 * splits:
                plan = SkinnyPlan(width, splits, tiles, tiles * splits)
                cost = -(-k_iters // splits) * unit_cost + 64 * width * 4 / 2
            else:
                continue
            if best is None or cost < best[0]:
                best = (cost, plan)
    assert best is not None  # splits = 1 always fits
    return best[1]


class LinearOp:
    """`linear`: the GEMV kernel for a few token rows, cuBLASLt for the rest."""

    def __init__(self, rt: CudaRuntime) -> None:
        self._rt = rt
        # Created now, not at the first large linear: that one may be inside a graph capture.
        tuning = None
        if rt.features.gemm_tuning:
            folder = rt.kernels.compiler.cache_dir
            tuning = GemmTuningStore(GemmTuningStore.file_for(folder, rt.device_name, CublasLtGemm.library_version()))
        workspace = rt.workspace("cublaslt", WORKSPACE_BYTES)
        evict = rt.evict_l2 if rt.features.hbm_tuning else None
        self._gemm: CublasLtGemm | None = CublasLtGemm(rt.stream_handle, workspace, tuning, rt.l2_bytes, evict)
        # Ones of each width whose norms are folded: the norm kernel's weight where a folded
        # projection still runs it (more token rows than the GEMV takes).
        self._unit_norms: dict[int, CudaTensor] = {}
        self._tensor_maps: dict[tuple, TensorMap] = {}  # the skinny GEMM's (`_rows_map`)
        self._skinny_plans: dict[tuple, SkinnyPlan] = {}
        # At most this many token rows of a row wider than NORM_IN_GEMV_MAX_WIDTH go through the
        # GEMV kernels (public so that the tests run both paths on any device).
        per_sm = rt.peak_bandwidth / rt.num_sms
        self.wide_gemv_rows = 1 if per_sm >= WIDE_GEMV_MAX_BANDWIDTH_PER_SM else GEMV_MAX_TOKENS

    def gemv_rows(self, inner: int) -> int:
        """The most token rows the GEMV kernels take for rows of `inner` elements; more go to
        cuBLASLt or the skinny GEMM."""
        if inner <= NORM_IN_GEMV_MAX_WIDTH or self._rt.features.batch_invariant:
            return GEMV_MAX_TOKENS
        return self.wide_gemv_rows

    def _first_mma_rows(self) -> int:
        """The fewest token rows the tensor-core GEMV takes: 2, or 1 where the step's rows must
        not change a row's bits (`batch_invariant`: the one-row SIMT kernels sum in another order)."""
        return 1 if self._rt.features.batch_invariant else 2

    def fold_rmsnorm(self, norm_weight: CudaTensor, weight: CudaTensor) -> bool:
        """Scale the weight's columns by the norm weight in place where that removes the norm
        from every block's start in a decode step: rows of at least FOLD_NORM_MIN_WIDTH (narrower
        ones are normalised inside the GEMV), bf16, a width of whole 16-byte loads. The folded
        GEMV then sums x^2 from the chunks it multiplies and scales its row sums at the end. On
        an H200, Llama-3.1-8B batch 1: see docs/cuda-notes.md run 7."""
        checks.rank(weight, "weight", 2)
        width = weight.shape[1]
        checks.dtype(norm_weight, "norm_weight", _FLOAT_TYPES)
        checks.shape(norm_weight, "norm_weight", (width,))
        rt = self._rt
        if not rt.features.gemv_fused or weight.dtype is not DType.BF16:
            return False
        if width < FOLD_NORM_MIN_WIDTH or width % 8:
            return False
        rt.forbid_in_capture("fold_rmsnorm")
        if width not in self._unit_norms:
            ones = rt.workspace(f"unit_norm_{width}", 2 * width)
            check("cuMemsetD16Async", cu.cuMemsetD16Async(ones, 0x3F80, width, rt.stream_handle))  # bf16 1.0
            self._unit_norms[width] = CudaTensor(ones, (width,), DType.BF16, self)
        count = weight.num_elements
        blocks = int(min(-(-count // 256), rt.num_sms * 8))
        symbol = f"scale_columns_bf16_{checks.type_suffix(norm_weight.dtype)}"
        columns = np.int32(width)
        rt.launch("elementwise", symbol, (blocks,), 256, weight.address, norm_weight.address, np.int64(count), columns)
        return True

    def rms_after_product(self, x: CudaTensor, norm_weight: CudaTensor | None) -> bool:
        """Whether the product of x with a projection whose norm weight is folded into it
        (`norm_weight` None) leaves the norm's RMS to the kernel after it
        (the `rms_after_product` feature): past the GEMV sizes, bf16 rows of whole 16-byte loads,
        whichever GEMM takes the product. Those kernels (`act_mul_rms`, RoPE's `rms_source`) scale
        by 1 / sqrt(mean(x^2) + eps), the value the norm kernel takes."""
        features = self._rt.features
        num_tokens, width = x.shape
        return (
            norm_weight is None
            and features.rms_after_product
            and self.gemv_rows(width) < num_tokens <= _MAX_GRID_Y
            and x.dtype is DType.BF16
            and width % 8 == 0
        )

    def __call__(self, x: CudaTensor, weight: CudaTensor, out: CudaTensor, bias: CudaTensor | None) -> None:
        num_tokens, num_rows, inner = _check_linear(x, weight, out, bias)
        if num_tokens == 0:
            return
        gemv_rows = self.gemv_rows(inner)
        if self._first_mma_rows() <= num_tokens <= gemv_rows and inner % 32 == 0:
            self._gemv_tensor_cores(x, weight, out, bias, num_tokens, num_rows, inner)
        elif num_tokens <= gemv_rows and inner % 8 == 0:
            self._gemv(x, weight, out, bias, num_tokens, num_rows, inner)
        elif not self._skinny(x, weight, out, bias, checks.type_suffix(out.dtype)):
            self._cublas(x, weight, out, bias, num_tokens, num_rows, inner)

    def linear_add(self, x: CudaTensor, weight: CudaTensor, residual: CudaTensor, scratch: CudaTensor) -> None:
        """residual += x weight^T: for a few token rows one GEMV that adds into the residual
        itself; past them with `rms_after_product` cuBLASLt adding into it (beta = 1; `scratch`
        is where its first call times the candidates); else the product into `scratch` and an
        add."""
        num_tokens = _check_linear(x, weight, residual, None)[0]
        checks.dtype(residual, "residual", (DType.BF16,))
        checks.dtype(scratch, "scratch", (DType.BF16,))
        checks.shape(scratch, "scratch", residual.shape)
        if num_tokens == 0 or self._fused_gemv(x, weight, residual, None, "add", None, 0.0):
            return
        features = self._rt.features
        if num_tokens > self.gemv_rows(x.shape[1]) and features.rms_after_product:
            checks.dtype(x, "x", (DType.BF16,))
            self._cublas(x, weight, residual, None, num_tokens, weight.shape[0], weight.shape[1], scratch)
            return
        self(x, weight, scratch, None)
        add_into(self._rt, scratch, residual)

    def rmsnorm_linear(
        self,
        x: CudaTensor,
        norm_weight: CudaTensor | None,
        eps: float,
        weight: CudaTensor,
        out: CudaTensor,
        normed: CudaTensor,
        bias: CudaTensor | None = None,
        activation: Activation | None = None,
        scratch: CudaTensor | None = None,
    ) -> None:
        """out = rmsnorm(x) weight^T (+ bias), or with `activation` act(rmsnorm(x) gate^T) *
        (rmsnorm(x) up^T) for weight = [gate; up]. For a few narrow token rows one GEMV that
        normalises x as it loads it; else the norm kernel into `normed`, then (a few rows, gated)
        one GEMV that applies the activation to its own rows, or the product (into `scratch`
        when gated) and act_mul. Without `norm_weight` (folded into `weight`): for up to
        `gemv_rows` token rows one GEMV that scales its row sums by each row's inverse RMS, else the
        norm kernel with a unit weight first."""
        if activation is None:
            num_tokens = _check_linear(x, weight, out, bias)[0]
        else:
            if scratch is None or bias is not None:
                raise ValueError("rmsnorm_linear: a gated product takes a scratch tensor and no bias")
            num_tokens, width, _ = _check_linear(x, weight, scratch, None)
            if width % 2:
                raise ValueError(f"weight: {width} rows are not gate | up halves")
            checks.shape(out, "out", (num_tokens, width // 2))
            checks.dtype(out, "out", (scratch.dtype,))
        checks.shape(normed, "normed", x.shape)
        if num_tokens == 0:
            return
        gated = activation is not None
        if (
            gated
            and out.dtype is DType.BF16
            and out.shape[1] % 8 == 0
            and self.rms_after_product(x, norm_weight)
        ):
            assert activation is not None and scratch is not None
            self(x, weight, scratch, None)
            act_mul_rms(self._rt, scratch, activation, x, eps, out)
            return
        if norm_weight is None:  # folded into `weight`
            if self._folded_gemv(x, weight, out, bias, eps, activation):
                return
            norm_weight = self._unit_norms.get(x.shape[1])
            if norm_weight is None:
                raise ValueError(f"rmsnorm_linear: no norm weight, and no norm of width {x.shape[1]} was folded")
        checks.dtype(norm_weight, "norm_weight", _FLOAT_TYPES)
        checks.shape(norm_weight, "norm_weight", (x.shape[1],))
        what = f"rmsnorm_{checks.type_suffix(norm_weight.dtype)}"
        if gated:
            what += f"_gated_{_ACTIVATION_NAMES[activation]}"
        if x.shape[1] <= NORM_IN_GEMV_MAX_WIDTH and self._fused_gemv(
            x, weight, out, bias, what, norm_weight, eps, gated
        ):
            return
        rmsnorm(self._rt, x, None, norm_weight, eps, normed)
        if activation is None:
            self(normed, weight, out, bias)
        elif not self._fused_gemv(normed, weight, out, None, f"gated_{_ACTIVATION_NAMES[activation]}", None, 0.0, True):
            assert scratch is not None
            self(normed, weight, scratch, None)
            act_mul(self._rt, scratch, activation, out)

    def rmsnorm_linear_rope(
        self,
        x: CudaTensor,
        norm_weight: CudaTensor | None,
        eps: float,
        weight: CudaTensor,
        bias: CudaTensor | None,
        q_out: CudaTensor,
        rope: RopeTargets,
    ) -> bool:
        """rmsnorm(x) times the fused q | k | v projection as one GEMV that normalises x as it
        loads it and rotates q and k and writes the cache in its epilogue (one token row of up to
        NORM_IN_GEMV_MAX_WIDTH; see gemv.cu). Returns False where it does not apply; the caller
        then runs `rmsnorm_linear` and `rope_and_cache`. On an H200: SmolLM2-135M batch 1
        641 us per step against 676 us with the RoPE kernel; at width 4096 (the norm kernel
        first) it was slower than the RoPE kernel, 4373-4415 us against 4231-4272 us, and so it
        was with the norm folded into the weight (no norm weight: 4208 against 4062 us)."""
        heads = rope.heads
        features = heads.q_size + 2 * heads.kv_size
        if norm_weight is None or not self.rope_epilogue(x.shape[1]):
            return False
        if x.shape[0] != 1 or weight.shape[0] != features:
            return False
        checks.dtype(x, "x", (DType.BF16,))
        checks.dtype(weight, "weight", (DType.BF16,))
        checks.shape(weight, "weight", (features, x.shape[1]))
        checks.dtype(norm_weight, "norm_weight", _FLOAT_TYPES)
        checks.shape(norm_weight, "norm_weight", (x.shape[1],))
        if bias is not None:
            checks.shape(bias, "bias", (features,))
            checks.dtype(bias, "bias", (DType.BF16,))
        what = f"rmsnorm_{checks.type_suffix(norm_weight.dtype)}_rope_{checks.type_suffix(rope.table.dtype)}"
        rows = 4 if features // 4 >= 2 * self._rt.num_sms else 2
        self._rt.launch(
            "gemv",
            f"gemv_{what}_r{rows}_t1",
            (-(-features // rows),),
            _GEMV_WARPS * 32,
            *_product_args(x, weight, bias, q_out, features),
            norm_weight.address,
            np.float32(eps),
            rope.positions,
            rope.slot_mapping,
            rope.table.address,
            np.int32(rope.table.shape[0]),
            rope.k_plane,
            rope.v_plane,
            np.int32(heads.num_q_heads),
            np.int32(heads.num_kv_heads),
            np.int32(heads.head_dim),
            np.int32(rope.block_size),
        )
        return True

    def rope_epilogue(self, width: int) -> bool:
        """Whether a one-token qkv projection of rows `width` wide takes the RoPE and cache write
        in its GEMV (`rmsnorm_linear_rope`), given its norm weight unfolded: the epilogue takes
        unscaled sums, so a layer keeps such a norm out of its weight (`CudaAttention.layer`)."""
        flags = self._rt.features
        return (flags.gemv_fused and flags.gemv_rope and not flags.batch_invariant
                and width % 8 == 0 and width <= NORM_IN_GEMV_MAX_WIDTH)

    def _folded_gemv(
        self,
        x: CudaTensor,
        weight: CudaTensor,
        out: CudaTensor,
        bias: CudaTensor | None,
        eps: float,
        activation: Activation | None,
    ) -> bool:
        """One token row through `gemv_folded_*`, 2..8 through `gemv_mma_folded_*` (the norm
        weight is in `weight`; the caller checked the shapes): returns False where it does not
        apply (more rows, K not a multiple of the loads, a gated output that is not bf16,
        `ATLAS_CUDA_DISABLE=gemv_fused`). Without the 2..8-row form a k = 4 verify step of the 8B
        ran 65 norm kernels more than a decode step."""
        num_tokens, inner = x.shape
        if not self._rt.features.gemv_fused or (activation is not None and out.dtype is not DType.BF16):
            return False
        features = out.shape[1]
        what = checks.type_suffix(out.dtype) if activation is None else f"gated_{_ACTIVATION_NAMES[activation]}"
        if self._first_mma_rows() <= num_tokens <= self.gemv_rows(inner) and inner % 32 == 0:
            symbol, threads = f"gemv_mma_folded_{what}", _GEMV_MMA_WIDE_WARPS * 32
            grid = -(-features // (16 if activation is None else 8))
        elif num_tokens == 1 and inner % 8 == 0:
            if activation is None:
                rows = _rows_per_block(features, self._rt.num_sms)
                grid = -(-features // rows)
            else:
                rows = 4 if features // 2 >= 2 * self._rt.num_sms else 2
                grid = -(-features // (rows // 2))
            symbol, threads = f"gemv_folded_{what}_r{rows}_t1", _GEMV_WARPS * 32
        else:
            return False
        self._rt.launch(
            "gemv",
            symbol,
            (grid,),
            threads,
            *_product_args(x, weight, bias, out, features),
            0,
            np.float32(eps),
        )
        return True

    def _fused_gemv(
        self,
        x: CudaTensor,
        weight: CudaTensor,
        out: CudaTensor,
        bias: CudaTensor | None,
        what: str,
        norm_weight: CudaTensor | None,
        eps: float,
        gated: bool = False,
    ) -> bool:
        """Launch `gemv_<what>` (one token row), `gemv_mma_<what>` (2..8) or, for the gated and
        add forms, `gemm_skinny_<what>` (9..SKINNY_MAX_TOKENS) and return True, or return False
        where no fused kernel applies: more rows (cuBLASLt), K not a multiple of the loads, an
        output that is not bf16, or `ATLAS_CUDA_DISABLE=gemv_fused`."""
        num_tokens, inner = x.shape
        features = out.shape[1]
        if not self._rt.features.gemv_fused or out.dtype is not DType.BF16:
            return False
        if num_tokens > self.gemv_rows(inner):
            # The skinny GEMM has no norm prologue: the caller runs the norm kernel first.
            unnormed = what == "add" or what.startswith("gated_")
            return unnormed and self._skinny(x, weight, out, bias, what, gated)
        if self._first_mma_rows() <= num_tokens and inner % 32 == 0:
            symbol, threads = _mma_symbol(what, inner)
            grid = -(-features // (8 if gated else 16))
        elif num_tokens == 1 and inner % 8 == 0:
            if gated:  # two features (four weight rows) per block while there are two blocks per SM
                rows = 4 if features // 2 >= 2 * self._rt.num_sms else 2
                grid = -(-features // (rows // 2))
            else:
                rows = _rows_per_block(features, self._rt.num_sms)
                grid = -(-features // rows)
            symbol, threads = f"gemv_{what}_r{rows}_t1", _GEMV_WARPS * 32
            if not gated and self._narrow(rows, inner, grid):
                symbol, threads = f"gemv_{what}_r{rows}_w2_t1", 2 * 32
        else:
            return False
        self._rt.launch(
            "gemv",
            symbol,
            (grid,),
            threads,
            *_product_args(x, weight, bias, out, features),
            norm_weight.address if norm_weight is not None else 0,
            np.float32(eps),
        )
        return True

    def _narrow(self, rows: int, inner: int, blocks: int) -> bool:
        """`_narrow_warps` where the `gemv_narrow` feature is on (and rows need not be batch invariant:
        2 warps split K otherwise than the kernels of more token rows)."""
        flags = self._rt.features
        return flags.gemv_narrow and not flags.batch_invariant and _narrow_warps(rows, inner, blocks, self._rt.num_sms)

    def _gemv(self, x, weight, out, bias, num_tokens: int, num_rows: int, inner: int) -> None:
        # A block per ROWS output features (its warps split K).
        rows_per_block = _rows_per_block(num_rows, self._rt.num_sms)
        tokens = next(t for t in (1, 2, 4, 8) if t >= num_tokens)
        symbol = f"gemv_{checks.type_suffix(out.dtype)}_r{rows_per_block}_t{tokens}"
        threads = _GEMV_WARPS * 32
        blocks = -(-num_rows // rows_per_block)
        if tokens == 1 and self._narrow(rows_per_block, inner, blocks):
            symbol, threads = f"gemv_{checks.type_suffix(out.dtype)}_r{rows_per_block}_w2_t1", 2 * 32
        self._rt.launch(
            "gemv",
            symbol,
            (blocks,),
            threads,
            *_product_args(x, weight, bias, out, num_rows),
        )

    def _gemv_tensor_cores(self, x, weight, out, bias, num_tokens: int, num_rows: int, inner: int) -> None:
        # 16 output features per block; the tokens are the mma's n = 8 columns.
        symbol, threads = _mma_symbol(checks.type_suffix(out.dtype), inner)
        self._rt.launch("gemv", symbol, (-(-num_rows // 16),), threads, *_product_args(x, weight, bias, out, num_rows))

    def _skinny(
        self,
        x: CudaTensor,
        weight: CudaTensor,
        out: CudaTensor,
        bias: CudaTensor | None,
        what: str,
        gated: bool = False,
    ) -> bool:
        """Launch `gemm_skinny_<what>_<width>` for more than `gemv_rows` and at most
        SKINNY_MAX_TOKENS token rows and return True, or return False where it does not apply
        (other row counts, K not a multiple of 8, a weight that is not bf16, a GPU that is not
        sm_90, `skinny_gemm` off). `skinny_plan` picks the tile width and the split of K; weights
        and x reach shared memory through TMA (tma.py)."""
        rt = self._rt
        num_tokens, inner = x.shape
        if not (rt.features.skinny_gemm and self.gemv_rows(inner) < num_tokens <= SKINNY_MAX_TOKENS):
            return False
        if inner % 8 or weight.dtype is not DType.BF16 or rt.compute_capability != (9, 0):
            return False  # (the kernels are sm_90a's: TMA, wgmma, clusters)
        features = out.shape[1]
        plan_key = (features, gated, inner)
        plan = self._skinny_plans.get(plan_key)
        if plan is None:

            def cluster_blocks(width: int, splits: int) -> int:
                symbol = f"gemm_skinny_{what}_{width}"
                return rt.cluster_blocks("gemv", symbol, _SKINNY_THREADS, skinny_shared_bytes(width), splits)

            plan = self._skinny_plans[plan_key] = skinny_plan(features, gated, inner, rt.num_sms, cluster_blocks)
        rt.launch(
            "gemv",
            f"gemm_skinny_{what}_{plan.width}",
            (plan.grid,),
            _SKINNY_THREADS,
            self._rows_map(weight, plan.width // 2 if gated else plan.width),
            self._rows_map(x, skinny_x_box_rows(num_tokens)),
            bias.address if bias is not None else 0,
            out.address,
            np.int32(num_tokens),
            np.int32(features),
            np.int32(inner),
            np.int32(plan.tiles),
            np.int32(plan.splits),
            shared_bytes=skinny_shared_bytes(plan.width),
            cluster=plan.splits,
        )
        return True

    def _rows_map(self, matrix: CudaTensor, box_rows: int) -> TensorMap:
        """The skinny GEMM's tensor map of a bf16 matrix in boxes of [box_rows][64], encoded once
        per (address, shape, box): weights, and the few activation buffers a step uses."""
        key = (matrix.address, matrix.shape, box_rows)
        tensor_map = self._tensor_maps.get(key)
        if tensor_map is None:
            rows, width = matrix.shape
            tensor_map = self._tensor_maps[key] = bf16_rows_map(matrix.address, rows, width, box_rows)
        return tensor_map

    def _cublas(
        self,
        x,
        weight,
        out,
        bias,
        num_tokens: int,
        num_rows: int,
        inner: int,
        accumulate_timing: CudaTensor | None = None,
    ) -> None:
        """out = x weight^T (+ bias), or with `accumulate_timing` (a tensor of out's shape for the
        first call's candidate timings) out += x weight^T."""
        if self._gemm is None:
            raise RuntimeError("linear: the backend was closed")
        fused_bias = bias is not None and out.dtype is DType.BF16
        self._rt.flush_uploads()  # cuBLASLt holds the stream handle: queued weight uploads go first
        self._gemm.matmul(
            x.address,
            weight.address,
            out.address,
            num_tokens,
            num_rows,
            inner,
            DType.BF16,
            out.dtype,
            bias.address if fused_bias else None,
            may_synchronize=not self._rt.capturing,
            accumulate_timing_out=accumulate_timing.address if accumulate_timing is not None else None,
        )
        if bias is not None and not fused_bias:
            total = num_tokens * num_rows
            blocks = int(min(-(-total // 256), self._rt.num_sms * 8))
            self._rt.launch(
                "gemv",
                f"add_bias_{checks.type_suffix(out.dtype)}",
                (blocks,),
                256,
                out.address,
                bias.address,
                np.int32(num_tokens),
                np.int32(num_rows),
            )

    @property
    def gemm(self) -> CublasLtGemm | None:
        """Its cuBLASLt wrapper (None once closed)."""
        return self._gemm

    @property
    def tuning_stats(self) -> TuningStats:
        """Its cuBLASLt wrapper's shapes and tuning time so far (empty once closed)."""
        return self._gemm.stats if self._gemm is not None else TuningStats()

    def close(self) -> None:
        if self._gemm is not None:
            self._gemm.close()
            self._gemm = None
