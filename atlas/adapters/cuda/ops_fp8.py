"""Projections over FP8 (E4M3) weights: the decode GEMVs that read E4M3 bytes and their scales
(gemv_fp8.cu), and past them x quantized to E4M3 (fp8_quantize.cu) for cuBLASLt's FP8 tensor
cores with the weights' scales (per channel as outer vectors, or 128 x 128 blocks).

Where the activations are rounded:
  - up to GEMV_MAX_TOKENS rows, never: the GEMVs multiply bf16 x by the exact dequantized weight
    (f32 accumulation), so they agree with the mock's dequantization to bf16 rounding of the
    product, as the bf16 GEMVs do;
  - past them, x is quantized to E4M3 per token (per-channel weights) or per 1 x 128 group
    (block weights), as the checkpoints' own activation schemes say (dynamic per token, dynamic
    per group of 128): a relative error of at most 2^-4 per value of x (3 mantissa bits), about
    2^-4 / sqrt(3) ~ 3.6% of each product's typical size, the same order as the weights' own
    rounding. The RMSNorm before a projection is taken in the quantizing kernel.
Norm weights are never folded into E4M3 columns: the one-row GEMV (bf16 out) applies the norm to
x itself, the norm kernel runs before the other decode GEMVs, the quantizing kernel takes it
before a GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver as cu

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.cublaslt import WORKSPACE_BYTES, CublasLtGemm, Fp8Scales
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.gemm_tuning import GemmTuningStore, TuningStats
from atlas.adapters.cuda.ops_dense import GEMV_MAX_TOKENS, act_mul, add_into, rmsnorm
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import NUMPY_DTYPES, DType, UnsupportedError
from atlas.ports.kernels.host_weights import Activation, HostLinear

BLOCK = 128  # the block layout's tile (rows and columns)
_GEMV_THREADS = 64  # gemv_fp8.cu's FP8_GEMV_WARPS
_MMA_THREADS = 256  # FP8_MMA_WARPS
_QUANT_THREADS = 256
_ACTIVATION_NAMES = {Activation.SILU: "silu", Activation.GELU_TANH: "gelu_tanh"}
# Workspaces of this module's intermediates (the callers' own are named apart).
_NORMED, _X, _X_SCALES, _PRODUCT = "fp8_normed", "fp8_x", "fp8_x_scales", "fp8_product"


@dataclass(frozen=True, slots=True)
class Fp8Matrix:
    """FP8 weights on the device: `data` [M, K] E4M3 bytes; `scales` f32 multipliers, per output
    row [M] or (`block`) per 128 x 128 tile [ceil(M / 128), L4], each row of tiles padded to L4 =
    ceil(K / 128) rounded up to 4 (cuBLASLt's stride rule; the pad is zeros)."""

    data: CudaTensor
    scales: CudaTensor
    block: bool

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape  # type: ignore[return-value]

    @property
    def scale_stride(self) -> int:
        return self.scales.shape[1] if self.block else 0


def upload_fp8(rt: CudaRuntime, upload, host: HostLinear, what: str) -> Fp8Matrix:
    """`host` (E4M3 weight with scales, [M, K]) on the device. Raises `UnsupportedError` off
    Hopper (cuBLASLt's FP8 scale modes are sm_90's), for blocks other than 128 x 128 and for an
    input width the kernels cannot take (not a multiple of 16), `ValueError` for scales that do
    not fit the weight."""
    if rt.compute_capability != (9, 0):
        major, minor = rt.compute_capability
        raise UnsupportedError(f"{what}: FP8 weights run on Hopper (sm_90) GPUs only; this one is sm_{major}{minor}")
    weight = np.asarray(host.weight)
    if weight.ndim != 2 or weight.dtype != NUMPY_DTYPES[DType.FP8_E4M3]:
        raise ValueError(f"{what}: quantized weights must be float8_e4m3fn [out, in], got {weight.dtype} "
                         f"{weight.shape}")
    rows, inner = weight.shape
    if inner % 16:
        raise UnsupportedError(f"{what}: FP8 weights need an input width that is a multiple of 16, got {inner}")
    scales = np.asarray(host.scales, np.float32)
    if host.block_shape is None:
        if scales.shape != (rows,):
            raise ValueError(f"{what}: per-channel scales must be [{rows}], got {list(scales.shape)}")
        return Fp8Matrix(upload(weight, DType.FP8_E4M3), upload(scales, DType.F32), False)
    if tuple(host.block_shape) != (BLOCK, BLOCK):
        raise UnsupportedError(f"{what}: FP8 blocks of {list(host.block_shape)}; the CUDA backend runs 128 x 128")
    tiles = (-(-rows // BLOCK), -(-inner // BLOCK))
    if scales.shape != tiles:
        raise ValueError(f"{what}: block scales must be {list(tiles)}, got {list(scales.shape)}")
    padded = np.zeros((tiles[0], -(-tiles[1] // 4) * 4), np.float32)
    padded[:, : tiles[1]] = scales
    return Fp8Matrix(upload(weight, DType.FP8_E4M3), upload(padded, DType.F32), True)


def _resident_suffix(inner: int) -> str:
    """The token quantizer that holds a row of `inner` columns in registers (`_r<chunks>`, chunks
    of 8 columns a thread: the fewest of 1, 2, 4, 8 that hold it), or "" for the kernel that reads
    a wider row three times (fp8_quantize.cu)."""
    chunks = -(-inner // (8 * _QUANT_THREADS))
    return next((f"_r{c}" for c in (1, 2, 4, 8) if chunks <= c), "")


def _rows_per_block(num_rows: int, num_sms: int) -> int:
    """Output rows per block of the one-token GEMV: more while there are still two blocks per SM."""
    return next((r for r in (4, 2) if num_rows // r >= 2 * num_sms), 1)


class Fp8LinearOp:
    """out = [rmsnorm](x) W^T (+ bias), its gated form and its residual-add form, over `Fp8Matrix`
    weights: GEMVs up to GEMV_MAX_TOKENS rows (2..8 on tensor cores where K % 64 == 0), then
    quantized x on cuBLASLt's FP8 tensor cores."""

    def __init__(self, rt: CudaRuntime) -> None:
        self._rt = rt
        tuning = None
        if rt.features.gemm_tuning:
            folder = rt.kernels.compiler.cache_dir
            name = f"{rt.device_name} fp8"
            tuning = GemmTuningStore(GemmTuningStore.file_for(folder, name, CublasLtGemm.library_version()))
        workspace = rt.workspace("cublaslt_fp8", WORKSPACE_BYTES)
        evict = rt.evict_l2 if rt.features.hbm_tuning else None
        self._gemm: CublasLtGemm | None = CublasLtGemm(rt.stream_handle, workspace, tuning, rt.l2_bytes, evict,
                                                       fast_accum=rt.features.fp8_fast_accum)
        self._no_accumulate: set[tuple[int, int, bool]] = set()  # weight shapes cuBLASLt cannot add into

    # -- the three forms ------------------------------------------------------------------
    def project(
        self, x: CudaTensor, matrix: Fp8Matrix, out: CudaTensor, bias: CudaTensor | None, norm: CudaTensor | None,
        eps: float,
    ) -> None:
        """out = [rmsnorm(x, norm)] W^T (+ bias).  x [N, K] bf16, out [N, M] bf16 or f32."""
        num_tokens = self._check(x, matrix, out, matrix.shape[0])
        if num_tokens == 0:
            return
        if num_tokens <= GEMV_MAX_TOKENS:
            source, inside = self._gemv_input(x, norm, eps, out)
            if self._gemv(source, matrix, out, bias, checks.type_suffix(out.dtype), norm=inside, eps=eps):
                return
        product = self._gemm_product(x, matrix, norm, eps, out)
        if product.address != out.address:
            check("cuMemcpyDtoDAsync",
                  cu.cuMemcpyDtoDAsync(out.address, product.address, out.num_bytes, self._rt.stream_handle))
        if bias is not None:
            self._add_bias(out, bias)

    def project_gated(
        self, x: CudaTensor, matrix: Fp8Matrix, out: CudaTensor, activation: Activation, norm: CudaTensor | None,
        eps: float,
    ) -> None:
        """out = act(g) * u for [g | u] = [rmsnorm(x, norm)] W^T, W = [gate; up].  out [N, M / 2] bf16."""
        rows = matrix.shape[0]
        if rows % 2:
            raise ValueError(f"weight: {rows} rows are not gate | up halves")
        num_tokens = self._check(x, matrix, out, rows // 2)
        checks.dtype(out, "out", (DType.BF16,))
        if num_tokens == 0:
            return
        what = f"gated_{_ACTIVATION_NAMES[activation]}"
        if num_tokens <= GEMV_MAX_TOKENS:
            source, inside = self._gemv_input(x, norm, eps, out)
            if self._gemv(source, matrix, out, None, what, True, norm=inside, eps=eps):
                return
        act_mul(self._rt, self._gemm_product(x, matrix, norm, eps, None), activation, out)

    def project_add(
        self, x: CudaTensor, matrix: Fp8Matrix, residual: CudaTensor, bias: CudaTensor | None,
        norm: CudaTensor | None, eps: float,
    ) -> None:
        """residual += [rmsnorm(x, norm)] W^T (+ bias), residual [N, M] bf16. The product is
        rounded to bf16 before the add, except past the GEMVs without bias for N a multiple of 4,
        where cuBLASLt adds into the residual in its epilogue (beta = 1) and rounds the sum once,
        as the bf16 `linear_add` does; where cuBLASLt has no such algorithm, the product and an
        add."""
        num_tokens = self._check(x, matrix, residual, matrix.shape[0])
        checks.dtype(residual, "residual", (DType.BF16,))
        if num_tokens == 0:
            return
        if num_tokens <= GEMV_MAX_TOKENS:
            source = self._input(x, norm, eps)
            if bias is None and self._gemv(source, matrix, residual, None, "add"):
                return
            delta = self._rt.scratch_tensor(_PRODUCT, residual.shape, DType.BF16)
            if self._gemv(source, matrix, delta, bias, "bf16"):
                add_into(self._rt, delta, residual)
                return
        if bias is None and self._gemm_accumulate(x, matrix, norm, eps, residual):
            return
        product = self._gemm_product(x, matrix, norm, eps, None)
        if bias is not None:
            self._add_bias(product, bias)
        add_into(self._rt, product, residual)

    @property
    def tuning_stats(self) -> TuningStats:
        """Its cuBLASLt wrapper's shapes and tuning time so far (empty once closed)."""
        return self._gemm.stats if self._gemm is not None else TuningStats()

    def close(self) -> None:
        if self._gemm is not None:
            self._gemm.close()
            self._gemm = None

    # -- paths --------------------------------------------------------------------------------
    def _check(self, x: CudaTensor, matrix: Fp8Matrix, out: CudaTensor, features: int) -> int:
        checks.rank(x, "x", 2)
        checks.dtype(x, "x", (DType.BF16,))
        checks.rank(out, "out", 2)
        checks.dtype(out, "out", (DType.BF16, DType.F32))
        num_tokens, inner = x.shape
        if matrix.shape[1] != inner:
            raise ValueError(f"weight: shape {list(matrix.shape)} does not take x of width {inner}")
        checks.shape(out, "out", (num_tokens, features))
        return num_tokens

    def _input(self, x: CudaTensor, norm: CudaTensor | None, eps: float) -> CudaTensor:
        """x, or rmsnorm(x) into a workspace (the GEMVs read bf16 rows as they are)."""
        if norm is None:
            return x
        normed = self._rt.scratch_tensor(_NORMED, x.shape, x.dtype)
        rmsnorm(self._rt, x, None, norm, eps, normed)
        return normed

    def _gemv_input(
        self, x: CudaTensor, norm: CudaTensor | None, eps: float, out: CudaTensor
    ) -> tuple[CudaTensor, CudaTensor | None]:
        """(x, norm) where the GEMV normalises x itself, saving the norm kernel before it: one row,
        bf16 out, `fp8_gemv_norm` on; else (`_input`'s x, None)."""
        flags = self._rt.features
        if (norm is not None and x.shape[0] == 1 and out.dtype is DType.BF16 and flags.fp8_gemv_norm
                and not flags.batch_invariant):
            return x, norm
        return self._input(x, norm, eps), None

    def _gemv(
        self, x: CudaTensor, matrix: Fp8Matrix, out: CudaTensor, bias: CudaTensor | None, what: str,
        gated: bool = False, norm: CudaTensor | None = None, eps: float = 0.0,
    ) -> bool:
        """Launch `gemv_fp8_<what>` (one row) or `gemv_fp8_mma_<what>` (2..8 rows, K % 64 == 0);
        with `norm` (one row only) `gemv_fp8_rmsnorm_<nw>_<what>`, out = <what>(rmsnorm(x) W^T).
        False where none applies (the caller takes the GEMM)."""
        num_tokens, inner = x.shape
        features = out.shape[1]
        suffix = "_blk" if matrix.block else ""
        norm_args: tuple = ()
        if norm is not None:
            checks.dtype(norm, "norm", (DType.BF16, DType.F32))
            checks.shape(norm, "norm", (inner,))
            what = f"rmsnorm_{checks.type_suffix(norm.dtype)}_{what}"
            norm_args = (norm.address, np.float32(eps))
        flags = self._rt.features
        # Batch invariant: one row takes the tensor-core kernel too (the SIMT kernel sums in another order).
        if num_tokens == 1 and not (flags.batch_invariant and inner % 64 == 0):
            if gated:  # two features (four weight rows) per block while there are two blocks per SM
                rows = 4 if features // 2 >= 2 * self._rt.num_sms else 2
                grid = -(-features // (rows // 2))
            else:
                rows = _rows_per_block(features, self._rt.num_sms)
                grid = -(-features // rows)
            symbol, threads, counts = f"gemv_fp8_{what}{suffix}_r{rows}", _GEMV_THREADS, ()
        elif inner % 64 == 0:
            symbol, threads = f"gemv_fp8_mma_{what}{suffix}", _MMA_THREADS
            grid, counts = -(-features // (8 if gated else 16)), (np.int32(num_tokens),)
        else:
            return False
        self._rt.launch(
            "gemv_fp8",
            symbol,
            (grid,),
            threads,
            x.address,
            matrix.data.address,
            matrix.scales.address,
            np.int32(matrix.scale_stride),
            bias.address if bias is not None else 0,
            out.address,
            *counts,
            np.int32(features),
            np.int32(inner),
            *norm_args,
        )
        return True

    def _gemm_product(
        self, x: CudaTensor, matrix: Fp8Matrix, norm: CudaTensor | None, eps: float, out: CudaTensor | None
    ) -> CudaTensor:
        """[rmsnorm](x) W^T through quantized x and cuBLASLt's FP8 GEMM: into `out` where given
        and N is a multiple of 4, else into a workspace; returns the [N, M] product. The product
        runs on N rounded up to 4 token rows (the block modes' rule, kept for both so one shape
        rule holds): x's padding rows are zeros, their outputs are never read."""
        gemm = self._open_gemm()
        quantized, fp8_scales, rows = self._quantize(x, matrix, norm, eps)
        num_tokens, inner = x.shape
        features = matrix.shape[0]
        direct = out is not None and rows == num_tokens
        out_dtype = out.dtype if out is not None else DType.BF16
        product = out if direct else self._rt.scratch_tensor(_PRODUCT, (rows, features), out_dtype)
        assert product is not None
        gemm.matmul(quantized.address, matrix.data.address, product.address, rows, features, inner, DType.FP8_E4M3,
                    out_dtype, may_synchronize=not self._rt.capturing, fp8_scales=fp8_scales)
        return product.rows(0, num_tokens)

    def _gemm_accumulate(
        self, x: CudaTensor, matrix: Fp8Matrix, norm: CudaTensor | None, eps: float, residual: CudaTensor
    ) -> bool:
        """residual (bf16) += [rmsnorm](x) W^T in cuBLASLt's epilogue (beta = 1: one rounding of
        the sum, no product in memory and no add kernel). False, the residual untouched, where
        that cannot run: N not a multiple of 4 (the GEMM's padding rows would land past the
        residual), or no cuBLASLt algorithm for beta = 1 with these scale modes (remembered per
        weight shape, so only the first such call quantizes x for nothing)."""
        gemm = self._open_gemm()
        num_tokens, inner = x.shape
        features = matrix.shape[0]
        key = (features, inner, matrix.block)
        if num_tokens % 4 or key in self._no_accumulate:
            return False
        quantized, fp8_scales, rows = self._quantize(x, matrix, norm, eps)
        timing = self._rt.scratch_tensor(_PRODUCT, residual.shape, DType.BF16)  # a first call times candidates here
        try:
            gemm.matmul(quantized.address, matrix.data.address, residual.address, rows, features, inner,
                        DType.FP8_E4M3, DType.BF16, may_synchronize=not self._rt.capturing,
                        accumulate_timing_out=timing.address, fp8_scales=fp8_scales)
        except RuntimeError:  # no algorithm: the quantized x is left unused, the caller quantizes again
            self._no_accumulate.add(key)
            return False
        return True

    def _open_gemm(self) -> CublasLtGemm:
        if self._gemm is None:
            raise RuntimeError("linear: the backend was closed")
        return self._gemm

    def _quantize(
        self, x: CudaTensor, matrix: Fp8Matrix, norm: CudaTensor | None, eps: float
    ) -> tuple[CudaTensor, Fp8Scales, int]:
        """[rmsnorm](x) to E4M3 in a workspace, N rounded up to 4 rows (zeros past N): (the
        quantized rows, the product's scales, that row count)."""
        rt = self._rt
        num_tokens, inner = x.shape
        rows = -(-num_tokens // 4) * 4
        quantized = rt.scratch_tensor(_X, (rows, inner), DType.FP8_E4M3)
        groups = -(-inner // BLOCK)
        scales = rt.scratch_tensor(_X_SCALES, (groups * rows if matrix.block else rows,), DType.F32)
        norm_suffix = "" if norm is None else f"_norm_{checks.type_suffix(norm.dtype)}"
        if norm is not None:
            checks.shape(norm, "norm", (inner,))
        common = (x.address, norm.address if norm is not None else 0, np.float32(eps), quantized.address,
                  scales.address, np.int32(num_tokens))
        if matrix.block:
            rt.launch("fp8_quantize", f"quantize_e4m3_group{norm_suffix}", (rows,), _QUANT_THREADS, *common,
                      np.int32(rows), np.int32(inner))
        else:
            rt.launch("fp8_quantize", f"quantize_e4m3_token{norm_suffix}{_resident_suffix(inner)}", (rows,),
                      _QUANT_THREADS, *common, np.int32(inner))
        return quantized, Fp8Scales(matrix.block, matrix.scales.address, scales.address), rows

    def _add_bias(self, out: CudaTensor, bias: CudaTensor) -> None:
        num_tokens, num_rows = out.shape
        checks.shape(bias, "bias", (num_rows,))
        total = num_tokens * num_rows
        blocks = int(min(-(-total // 256), self._rt.num_sms * 8))
        self._rt.launch("gemv", f"add_bias_{checks.type_suffix(out.dtype)}", (blocks,), 256, out.address,
                        bias.address, np.int32(num_tokens), np.int32(num_rows))
