"""bf16 and FP8 GEMMs through cuBLASLt (`nvmath.bindings.cublasLt`) for the prefill-sized `linear`.

out[N, M] = x[N, K] @ w[M, K]^T (+ bias[M]) in row-major terms is, in cuBLAS's column-major
terms, D[M, N] = op(A)[M, K] @ B[K, N] with A = w seen as a K x M matrix (ld K, transposed) and
B = x seen as K x N (ld K):

    row-major w [M, K]  ==  column-major A [K, M]   ->  op(A) = A^T  [M, K]
    row-major x [N, K]  ==  column-major B [K, N]
    row-major out [N, M] == column-major D [M, N]   (ld M)

A plan (descriptors, layouts, candidate algorithms) is built once per shape and reused; the
workspace is persistent so the call can be captured in a graph. fp32 accumulation. The first
shape of a token bucket (gemm_tuning.token_bucket) runs the heuristic query; the bucket's other
token counts reuse its chosen algorithm once `cublasLtMatmulAlgoCheck` accepts it for their
layouts (a heuristic query with its variants took ~5 ms a shape on an H200, and mixed serving
steps bring a new token count nearly every step: several GEMM shapes a step paid it).

FP8 (E4M3 x E4M3, Hopper): D = (scale_A op(A)) (scale_B op(B)) [+ C] with the scales as `Fp8Scales`
gives them (cuBLASLt 12.9+ on sm_90): outer vectors (a scale per weight row, i.e. per output
feature, and one per token), or 128 x 128 blocks for the weight with 1 x 128 groups for x. The
block modes take M and N multiples of 4; their scale tensors are
    weight [ceil(M / 128)][L4] (K-major, rows padded to L4 = ceil(K / 128) rounded up to 4),
    x      [ceil(K / 128)][N]  (token-major).

Algorithm choice: at a shape's first call the plan takes the stored winner of its token bucket
when the heuristic's candidates hold it (gemm_tuning.py); otherwise, when the call may
synchronise (not while a graph is captured), the heuristic's top `_HEURISTIC_CANDIDATES` (plus
split-K variants of its first two picks when N <= `_SPLIT_K_MAX_TOKENS`, for decode batches, and
for those its first pick with other tiles and clusters: always for weights larger than the L2,
for smaller ones where the L2 is evicted before each timed run, `CublasLtGemm`) are timed and
the fastest is kept and stored. Otherwise, and with tuning off, the heuristic's first
pick runs. A plan never changes its choice afterwards, so every call of a shape in a process
computes the same rounding (a graph captured cold and an eager call agree bit for bit); an eager
call of a shape before its capture, or a store from an earlier run, puts tuned algorithms into
graphs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from atlas.adapters.cuda import nvmath_bindings
from atlas.adapters.cuda.driver import CudaError
from atlas.adapters.cuda.gemm_tuning import CandidateTimer, GemmTuningStore, TuningStats, token_bucket
from atlas.ports.gpu import DType

log = logging.getLogger("atlas.cuda")
cublas, lt = nvmath_bindings.load()

# cudaDataType: CUDA_R_16BF, _16F, _32F, _8F_E4M3
_DATA_TYPES = {DType.BF16: 14, DType.F16: 2, DType.F32: 0, DType.FP8_E4M3: 28}
_OP_N, _OP_T = 0, 1
WORKSPACE_BYTES = 32 << 20
_HEURISTIC_CANDIDATES = 8
_SPLIT_K_MAX_TOKENS = 128
_SPLIT_K_FACTORS = (2, 4)
# Decode-sized N (<= _SPLIT_K_MAX_TOKENS): tiles of these many weight rows and clusters along the
# weight rows join the candidates (`_tile_variants`).
_TILE_ROWS = frozenset(range(32, 257, 16))
_TILE_CLUSTERS = (lt.ClusterShape.SHAPE_1x1x1, lt.ClusterShape.SHAPE_2x1x1, lt.ClusterShape.SHAPE_4x1x1)
_MIN_GAIN = 0.97  # another candidate must be 3% faster than the heuristic's pick to replace it
_HEURISTIC_DTYPE = np.dtype(lt.matmul_heuristic_result_dtype)
# The weight's scale modes (Fp8Scales.modes): one scale a row, or one a 128 x 128 tile.
_PER_CHANNEL = int(lt.MatmulMatrixScale.OUTER_VEC_32F)
_BLOCK_SCALED = int(lt.MatmulMatrixScale.BLK128x128_32F)


@dataclass(frozen=True, slots=True)
class Fp8Scales:
    """The scales of an FP8 product: `block` False, per weight row [M] and per token [N] (outer
    vectors); True, 128 x 128 weight blocks and 1 x 128 x groups (layouts: the module docstring).
    Addresses of f32 device arrays, 16-byte aligned."""

    block: bool
    weight_address: int
    x_address: int

    @property
    def modes(self) -> tuple[int, int]:
        """(A's, B's) `MatmulMatrixScale`: A is the weight, B is x."""
        if self.block:
            return _BLOCK_SCALED, int(lt.MatmulMatrixScale.VEC128_32F)
        return _PER_CHANNEL, _PER_CHANNEL


@dataclass(slots=True)
class _Plan:
    descriptor: int
    layouts: tuple[int, int, int]
    candidates: np.ndarray  # heuristic results; keeps the algorithm structs alive for matmul
    choice: int  # the candidate that runs
    tuning_key: str
    bias_attribute: np.ndarray | None
    accumulate: bool  # beta = 1: out += x w^T (C is D, in place)
    fp8: bool = False  # E4M3 operands: the scale pointers are set per call
    l2_resident: bool = False  # the weight fits the L2: its candidates are timed after an eviction

    @property
    def algorithm_address(self) -> int:
        return self.candidates.ctypes.data + self.choice * _HEURISTIC_DTYPE.itemsize

    def algorithm_bytes(self, index: int) -> bytes:
        return self.candidates[index]["algo"].tobytes()


class CublasLtGemm:
    """Cached cuBLASLt plans over one handle, stream and workspace.

    `tuning` None runs the heuristic's first pick always; a store makes `matmul` time the
    candidates of a new shape when the caller allows it. `l2_bytes`: the GPU's L2 size. The timer
    replays one product on the same weights, which a weight smaller than the L2 would serve from
    the L2 after the first run (the ranking would then be of L2 reads, not of the HBM stream a
    decode step sees): with `evict_l2` (enqueues reads that push everything else out of the L2)
    such a weight's candidates are timed after it, and race the tile variants (`_tile_variants`)
    as larger weights do; without it they do not. Block-scaled FP8 products never race tile
    variants (one computed wrong results on an H200). On an H200 at 64 tokens the FP8 o and down
    projections of Llama-3.1-8B ran 13.8 and 36.6 us with the heuristic's pick against 8.1 and
    19.0 with a tile variant, timed from HBM (docs/lab/cuda-runs.md).

    `fast_accum`: FP8 products with per-channel scales accumulate in the tensor cores' own
    precision, without promoting the partial sums to fp32 every few K steps (cuBLASLt's
    FAST_ACCUM, as vLLM's CUTLASS FP8 kernels and torch's `_scaled_mm(use_fast_accum=True)` run
    them). On an H200 the 8B's 8k FP8 prefill took 0.1661 s against 0.1766 with it off (0.164-0.166
    against 0.172 in another call), batch 64 4.267 against 4.311 ms a step; its error against
    transformers stayed within what E4M3 activations cost (tests/gpu/test_models.py, 500-token
    prefills: 7.50 against 7.25 times transformers-bf16's error for the 8B cut, the bound 12).
    Block-scaled products keep the promotion (DeepSeek-V3's recipe relies on it).
    """

    def __init__(
        self,
        stream_handle: int,
        workspace_address: int,
        tuning: GemmTuningStore | None = None,
        l2_bytes: int = 0,
        evict_l2: Callable[[], None] | None = None,
        fast_accum: bool = False,
    ) -> None:
        self._handle = lt.create()
        self._fast_accum = fast_accum
        self._l2_bytes = l2_bytes
        self._evict_l2 = evict_l2
        self._stream = stream_handle
        self._workspace = workspace_address
        self._plans: dict[tuple, _Plan] = {}
        self._bucket_plans: dict[tuple, _Plan] = {}  # the plan each token bucket's first shape built
        self._alpha = np.ones(1, dtype=np.float32)
        self._beta = np.zeros(1, dtype=np.float32)  # a plan that accumulates passes _alpha (1) as beta
        self._tuning = tuning
        self._timer = CandidateTimer(stream_handle) if tuning is not None else None
        self.stats = TuningStats()

    @staticmethod
    def library_version() -> int:
        return int(lt.get_version())

    def matmul(
        self,
        x_address: int,
        w_address: int,
        out_address: int,
        num_tokens: int,
        num_rows: int,
        inner: int,
        in_dtype: DType,
        out_dtype: DType,
        bias_address: int | None = None,
        may_synchronize: bool = False,
        accumulate_timing_out: int | None = None,
        fp8_scales: Fp8Scales | None = None,
    ) -> None:
        """Enqueue out = x @ w^T (+ bias) on the stream. With `may_synchronize` (never while a
        graph is captured) a shape's first call may time the candidates, running the product
        several times on these buffers and waiting for the stream. `accumulate_timing_out`: out
        += x @ w^T instead (the epilogue's beta = 1, one rounding of the sum), the candidates then
        timed on that buffer of out's shape, not on out. `fp8_scales`: E4M3 x and w (in_dtype
        FP8_E4M3) and their scales (no bias; accumulating, C is out in out_dtype, unscaled).
        Raises `RuntimeError` when cuBLASLt has no algorithm for the shape (the message names
        it); the plan is then not kept, so a caller may fall back."""
        accumulate = accumulate_timing_out is not None
        if (in_dtype is DType.FP8_E4M3) != (fp8_scales is not None):
            raise ValueError("matmul: FP8 operands need their scales, and only they take scales")
        if fp8_scales is not None and bias_address is not None:
            raise ValueError("matmul: an FP8 product takes no bias")
        modes = fp8_scales.modes if fp8_scales is not None else None
        shape = (num_rows, inner, in_dtype, out_dtype, bias_address is not None, accumulate, modes)
        key = (num_tokens, *shape)
        plan = self._plans.get(key)
        new_plan = plan is None
        if plan is None:
            scale_addresses = (fp8_scales.weight_address, fp8_scales.x_address) if fp8_scales is not None else None
            bucket_key = (token_bucket(num_tokens), *shape)
            bucket_plan = self._bucket_plans.get(bucket_key)
            if bucket_plan is not None:
                plan = self._derive(bucket_plan, num_tokens, num_rows, inner, in_dtype, out_dtype,
                                    bias_address is not None, modes, scale_addresses)
            if plan is None:
                plan = self._build(
                    num_tokens, num_rows, inner, in_dtype, out_dtype, bias_address is not None, accumulate, modes,
                    scale_addresses,
                )
                self._bucket_plans.setdefault(bucket_key, plan)
            else:
                new_plan = False  # the bucket's choice stands: nothing to time
                self.stats.num_derived += 1
            self._plans[key] = plan
            self.stats.num_plans += 1
        if fp8_scales is not None:
            _set(plan.descriptor, lt.MatmulDescAttribute.A_SCALE_POINTER, fp8_scales.weight_address)
            _set(plan.descriptor, lt.MatmulDescAttribute.B_SCALE_POINTER, fp8_scales.x_address)
        if plan.bias_attribute is not None:
            plan.bias_attribute[0] = bias_address
            lt.matmul_desc_set_attribute(
                plan.descriptor,
                lt.MatmulDescAttribute.BIAS_POINTER,
                plan.bias_attribute.ctypes.data,
                plan.bias_attribute.itemsize,
            )
        operands = (x_address, w_address, out_address)
        if new_plan and self._tuning is not None:
            timed = (x_address, w_address, accumulate_timing_out) if accumulate else operands
            self._choose(plan, timed, may_synchronize)
        self._enqueue(plan, plan.choice, operands)

    @property
    def tuning(self) -> GemmTuningStore | None:
        """The store of winners (None with tuning off)."""
        return self._tuning

    def _enqueue(self, plan: _Plan, candidate: int, operands: tuple[int, int, int]) -> None:
        x_address, w_address, out_address = operands
        a_layout, b_layout, d_layout = plan.layouts
        lt.matmul(
            self._handle,
            plan.descriptor,
            self._alpha.ctypes.data,
            w_address,
            a_layout,
            x_address,
            b_layout,
            (self._alpha if plan.accumulate else self._beta).ctypes.data,
            out_address,
            d_layout,
            out_address,
            d_layout,
            plan.candidates.ctypes.data + candidate * _HEURISTIC_DTYPE.itemsize,
            self._workspace,
            WORKSPACE_BYTES,
            self._stream,
        )

    def _choose(self, plan: _Plan, operands: tuple[int, int, int], may_synchronize: bool) -> None:
        """Take the bucket's stored winner when the candidates hold it; else time them all (only
        when allowed to synchronise) and store the fastest."""
        assert self._tuning is not None and self._timer is not None
        if len(plan.candidates) == 1:
            return
        winner = self._tuning.get(plan.tuning_key)
        if winner is not None:
            for index in range(len(plan.candidates)):
                if plan.algorithm_bytes(index) == winner:
                    plan.choice = index
                    self.stats.num_stored += 1
                    return
        if not may_synchronize:
            return
        started = time.perf_counter()
        times = [self._time(plan, index, operands) for index in range(len(plan.candidates))]
        self.stats.num_timed += 1
        self.stats.timing_s += time.perf_counter() - started
        best = int(np.argmin(times))
        if not math.isfinite(times[best]):
            return  # every candidate failed to run: keep the heuristic's pick
        if times[best] > _MIN_GAIN * times[0]:
            best = 0  # within the timing noise of the heuristic's pick: keep that
        plan.choice = best
        self._tuning.put(plan.tuning_key, plan.algorithm_bytes(best))
        log.debug("cuBLASLt %s: candidate %d of %d (%.1f us)", plan.tuning_key, best, len(times), times[best] * 1e6)

    def _time(self, plan: _Plan, candidate: int, operands: tuple[int, int, int]) -> float:
        assert self._timer is not None
        try:
            evict = self._evict_l2 if plan.l2_resident else None
            return self._timer.seconds(lambda: self._enqueue(plan, candidate, operands), evict)
        except (lt.cuBLASLtError, CudaError) as error:  # refused at run time, or not capturable
            log.debug("cuBLASLt %s: candidate %d fails (%s)", plan.tuning_key, candidate, error)
            return math.inf

    def _derive(
        self,
        base: _Plan,
        num_tokens: int,
        num_rows: int,
        inner: int,
        in_dtype: DType,
        out_dtype: DType,
        with_bias: bool,
        scale_modes: tuple[int, int] | None,
        scale_addresses: tuple[int, int] | None,
    ) -> _Plan | None:
        """A plan for `num_tokens` that runs the algorithm `base` (a plan of the same token
        bucket) chose, or None when cuBLASLt refuses that algorithm for this shape or it needs
        more than the workspace (the caller then builds a plan of its own)."""
        descriptor, bias_attribute = self._descriptor(in_dtype, with_bias, scale_modes, scale_addresses)
        layouts = self._layouts(num_tokens, num_rows, inner, in_dtype, out_dtype)
        chosen = base.candidates[base.choice : base.choice + 1].copy()
        checked = np.zeros(1, dtype=_HEURISTIC_DTYPE)
        a_layout, b_layout, d_layout = layouts
        try:
            lt.matmul_algo_check(
                self._handle, descriptor, a_layout, b_layout, d_layout, d_layout, chosen.ctypes.data, checked.ctypes.data
            )
            fits = int(checked[0]["workspace_size"]) <= WORKSPACE_BYTES
        except lt.cuBLASLtError:
            fits = False
        if not fits:
            _destroy(descriptor, layouts)
            return None
        chosen[0]["workspace_size"] = checked[0]["workspace_size"]
        return _Plan(descriptor, layouts, chosen, 0, base.tuning_key, bias_attribute, base.accumulate, base.fp8)

    def _descriptor(
        self,
        in_dtype: DType,
        with_bias: bool,
        scale_modes: tuple[int, int] | None,
        scale_addresses: tuple[int, int] | None,
    ) -> tuple[int, np.ndarray | None]:
        """A matmul descriptor (A transposed, fp32 compute) and the bias pointer's buffer."""
        descriptor = lt.matmul_desc_create(int(cublas.ComputeType.COMPUTE_32F), _DATA_TYPES[DType.F32])
        _set(descriptor, lt.MatmulDescAttribute.TRANSA, _OP_T)
        _set(descriptor, lt.MatmulDescAttribute.TRANSB, _OP_N)
        if self._fast(scale_modes):
            _set(descriptor, lt.MatmulDescAttribute.FAST_ACCUM, 1)
        if scale_modes is not None:
            _set(descriptor, lt.MatmulDescAttribute.A_SCALE_MODE, scale_modes[0])
            _set(descriptor, lt.MatmulDescAttribute.B_SCALE_MODE, scale_modes[1])
            # cuBLASLt 13 refuses the heuristic query of a vector or block scale mode without
            # its scale pointers set ("requires a custom pointer"); each call sets them again.
            assert scale_addresses is not None
            _set(descriptor, lt.MatmulDescAttribute.A_SCALE_POINTER, scale_addresses[0])
            _set(descriptor, lt.MatmulDescAttribute.B_SCALE_POINTER, scale_addresses[1])
        bias_attribute = None
        if with_bias:
            _set(descriptor, lt.MatmulDescAttribute.EPILOGUE, int(lt.Epilogue.BIAS))
            bias_dtype = lt.get_matmul_desc_attribute_dtype(lt.MatmulDescAttribute.BIAS_POINTER)
            bias_attribute = np.zeros(1, dtype=bias_dtype)
        return descriptor, bias_attribute

    @staticmethod
    def _layouts(num_tokens: int, num_rows: int, inner: int, in_dtype: DType, out_dtype: DType) -> tuple[int, int, int]:
        a_layout = lt.matrix_layout_create(_DATA_TYPES[in_dtype], inner, num_rows, inner)
        b_layout = lt.matrix_layout_create(_DATA_TYPES[in_dtype], inner, num_tokens, inner)
        d_layout = lt.matrix_layout_create(_DATA_TYPES[out_dtype], num_rows, num_tokens, num_rows)
        return a_layout, b_layout, d_layout

    def _build(
        self,
        num_tokens: int,
        num_rows: int,
        inner: int,
        in_dtype: DType,
        out_dtype: DType,
        with_bias: bool,
        accumulate: bool,
        scale_modes: tuple[int, int] | None = None,
        scale_addresses: tuple[int, int] | None = None,
    ) -> _Plan:
        descriptor, bias_attribute = self._descriptor(in_dtype, with_bias, scale_modes, scale_addresses)
        layouts = self._layouts(num_tokens, num_rows, inner, in_dtype, out_dtype)

        wanted = _HEURISTIC_CANDIDATES if self._tuning is not None else 1
        candidates = self._heuristic(descriptor, layouts, wanted)
        self.stats.num_heuristics += 1
        if len(candidates) == 0:
            _destroy(descriptor, layouts)
            raise RuntimeError(
                f"cuBLASLt has no algorithm for x [{num_tokens}, {inner}] @ w [{num_rows}, {inner}]^T "
                f"({in_dtype.value} -> {out_dtype.value})"
            )
        fits_l2 = num_rows * inner * in_dtype.itemsize <= self._l2_bytes
        l2_resident = fits_l2 and self._evict_l2 is not None
        if self._tuning is not None and num_tokens <= _SPLIT_K_MAX_TOKENS:
            variants = [self._split_k_variants(descriptor, layouts, candidates[:2])]
            # Tile variants of block-scaled products are not raced: on an H200 (cuBLASLt 13), one that
            # matmul_algo_check accepted returned 0.34 relative error with 128 x 128 weight scales
            # (tests/gpu/test_cuda_fp8_weights.py, every decode candidate applies the scales).
            block_scaled = scale_modes is not None and scale_modes[0] == _BLOCK_SCALED
            if (l2_resident or not fits_l2) and not block_scaled:
                variants.append(self._tile_variants(descriptor, layouts, candidates[0], num_tokens, candidates))
            candidates = np.concatenate([candidates, *variants])
        key = f"{token_bucket(num_tokens)},{num_rows},{inner},{in_dtype.value},{out_dtype.value},{int(with_bias)}"
        if accumulate:
            key += ",accumulate"
        if scale_modes is not None:
            key += ",scales{},{}".format(*scale_modes)
        if self._fast(scale_modes):
            key += ",fast"
        if l2_resident:
            key += ",hbm"  # a winner raced from the L2 (stored before evictions) is not this race's
        return _Plan(descriptor, layouts, candidates, 0, key, bias_attribute, accumulate, scale_modes is not None,
                     l2_resident)

    def _fast(self, scale_modes: tuple[int, int] | None) -> bool:
        """Whether an FP8 product with these scale modes accumulates without promotion."""
        return self._fast_accum and scale_modes is not None and scale_modes[0] == _PER_CHANNEL

    def _heuristic(self, descriptor: int, layouts: tuple[int, int, int], wanted: int) -> np.ndarray:
        a_layout, b_layout, d_layout = layouts
        preference = lt.matmul_preference_create()
        workspace_limit = np.array([WORKSPACE_BYTES], dtype=np.uint64)
        lt.matmul_preference_set_attribute(
            preference,
            lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES,
            workspace_limit.ctypes.data,
            workspace_limit.itemsize,
        )
        results = np.zeros(wanted, dtype=_HEURISTIC_DTYPE)
        found = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(
                self._handle,
                descriptor,
                a_layout,
                b_layout,
                d_layout,
                d_layout,
                preference,
                wanted,
                results.ctypes.data,
                found.ctypes.data,
            )
        finally:
            lt.matmul_preference_destroy(preference)
        return results[: int(found[0])].copy()

    def _split_k_variants(self, descriptor: int, layouts: tuple[int, int, int], bases: np.ndarray) -> np.ndarray:
        """Copies of `bases` that split K over 2 or 4 blocks (reducing in fp32 in the workspace),
        where cuBLASLt accepts them for this shape and they fit the workspace."""
        a_layout, b_layout, d_layout = layouts
        variants = []
        for base in bases:
            for factor in _SPLIT_K_FACTORS:
                variant = np.zeros(1, dtype=_HEURISTIC_DTYPE)
                variant[0]["algo"] = base["algo"]
                algorithm = variant.ctypes.data  # the algo struct is the record's first field
                checked = np.zeros(1, dtype=_HEURISTIC_DTYPE)
                try:
                    _set_config(algorithm, lt.MatmulAlgoConfigAttribute.SPLITK_NUM, factor)
                    _set_config(
                        algorithm, lt.MatmulAlgoConfigAttribute.REDUCTION_SCHEME, int(lt.ReductionScheme.COMPUTE_TYPE)
                    )
                    lt.matmul_algo_check(
                        self._handle, descriptor, a_layout, b_layout, d_layout, d_layout, algorithm, checked.ctypes.data
                    )
                except lt.cuBLASLtError:
                    continue
                if int(checked[0]["workspace_size"]) <= WORKSPACE_BYTES:
                    variant[0]["workspace_size"] = checked[0]["workspace_size"]
                    variants.append(variant)
        return np.concatenate(variants) if variants else np.zeros(0, dtype=_HEURISTIC_DTYPE)

    def _tile_variants(
        self, descriptor: int, layouts: tuple[int, int, int], base: np.void, num_tokens: int, known: np.ndarray
    ) -> np.ndarray:
        """Copies of `base` (the heuristic's first pick) with each tile of `_TILE_ROWS` weight rows
        by the token bucket's width, in clusters of 1, 2 or 4 blocks along the weight rows, K in
        `base`'s steps with the stage count left to cuBLASLt; those cuBLASLt accepts for this
        shape and `known` does not hold yet. The heuristic ranks few of these for decode-sized N:
        on an H200 at 64 tokens, Llama-3.1-8B's down projection (4096 x 14336) ran 31.5 us with
        48x64 tiles in clusters of 4, against 33.8 for the best of the heuristic's eight and
        their split-K variants."""
        a_layout, b_layout, d_layout = layouts
        width = next((w for w in (8, 16, 32, 64, 128) if w >= num_tokens), 128)
        record = np.zeros(1, dtype=_HEURISTIC_DTYPE)
        record[0]["algo"] = base["algo"]
        algorithm = record.ctypes.data
        stage = _get_config(algorithm, lt.MatmulAlgoConfigAttribute.STAGES_ID)
        auto_stages = lt.MatmulStages.__members__.get(_enum_name(lt.MatmulStages, stage).partition("x")[0] + "xAUTO")
        if auto_stages is not None and int(auto_stages) in _cap_values(algorithm, lt.MatmulAlgoCapAttribute.STAGES_IDS):
            stage = int(auto_stages)
        tiles = []
        for tile in _cap_values(algorithm, lt.MatmulAlgoCapAttribute.TILE_IDS):
            rows, _, columns = _enum_name(lt.MatmulTile, tile).removeprefix("TILE_").partition("x")
            if columns == str(width) and rows.isdigit() and int(rows) in _TILE_ROWS:
                tiles.append(tile)
        seen = {bytes(c["algo"].tobytes()) for c in known}
        variants = []
        for tile in tiles:
            for cluster in _TILE_CLUSTERS:
                variant = record.copy()
                address = variant.ctypes.data
                checked = np.zeros(1, dtype=_HEURISTIC_DTYPE)
                try:
                    _set_config(address, lt.MatmulAlgoConfigAttribute.TILE_ID, tile)
                    _set_config(address, lt.MatmulAlgoConfigAttribute.STAGES_ID, stage)
                    _set_config(address, lt.MatmulAlgoConfigAttribute.CLUSTER_SHAPE_ID, int(cluster))
                    _set_config(address, lt.MatmulAlgoConfigAttribute.SPLITK_NUM, 1)
                    lt.matmul_algo_check(
                        self._handle, descriptor, a_layout, b_layout, d_layout, d_layout, address, checked.ctypes.data
                    )
                except lt.cuBLASLtError:
                    continue
                algo_bytes = variant[0]["algo"].tobytes()
                if int(checked[0]["workspace_size"]) <= WORKSPACE_BYTES and algo_bytes not in seen:
                    seen.add(algo_bytes)
                    variant[0]["workspace_size"] = checked[0]["workspace_size"]
                    variants.append(variant)
        return np.concatenate(variants) if variants else np.zeros(0, dtype=_HEURISTIC_DTYPE)

    def close(self) -> None:
        for plan in self._plans.values():
            _destroy(plan.descriptor, plan.layouts)
        self._plans.clear()
        self._bucket_plans.clear()
        if self._timer is not None:
            self._timer.close()
        lt.destroy(self._handle)


def _destroy(descriptor: int, layouts: tuple[int, int, int]) -> None:
    for layout in layouts:
        lt.matrix_layout_destroy(layout)
    lt.matmul_desc_destroy(descriptor)


def _set(descriptor: int, attribute: lt.MatmulDescAttribute, value: int) -> None:
    buffer = np.array([value], dtype=lt.get_matmul_desc_attribute_dtype(attribute))
    lt.matmul_desc_set_attribute(descriptor, attribute, buffer.ctypes.data, buffer.itemsize)


def _get_config(algorithm_address: int, attribute: lt.MatmulAlgoConfigAttribute) -> int:
    buffer = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attribute))
    written = np.zeros(1, dtype=np.uint64)
    lt.matmul_algo_config_get_attribute(
        algorithm_address, attribute, buffer.ctypes.data, buffer.itemsize, written.ctypes.data
    )
    return int(buffer[0])


def _enum_name(kind: type, value: int) -> str:
    """`kind(value).name`, or "" for a value this binding does not name (a newer cuBLASLt's)."""
    try:
        return kind(value).name
    except ValueError:
        return ""


def _cap_values(algorithm_address: int, attribute: lt.MatmulAlgoCapAttribute) -> list[int]:
    """An array-valued capability of an algorithm (tile or stage ids): its size first, then it."""
    written = np.zeros(1, dtype=np.uint64)
    lt.matmul_algo_cap_get_attribute(algorithm_address, attribute, 0, 0, written.ctypes.data)
    values = np.zeros(int(written[0]) // 4, dtype=np.uint32)
    if len(values):
        size = values.nbytes
        lt.matmul_algo_cap_get_attribute(algorithm_address, attribute, values.ctypes.data, size, written.ctypes.data)
    return [int(v) for v in values]


def _set_config(algorithm_address: int, attribute: lt.MatmulAlgoConfigAttribute, value: int) -> None:
    buffer = np.array([value], dtype=lt.get_matmul_algo_config_attribute_dtype(attribute))
    lt.matmul_algo_config_set_attribute(algorithm_address, attribute, buffer.ctypes.data, buffer.itemsize)
