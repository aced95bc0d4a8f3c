"""The device context every op runs in: one device, one stream, the pool, the kernels.

`CudaRuntime` owns what the ops share: the stream their launches are ordered on, the memory
pool, pinned staging, persistent workspaces, and the loaded kernel library. Ops call
`launch(module, symbol, grid, block, *args)` with device addresses as Python ints and scalars
as numpy scalars (np.int32, np.float32, np.int64) so each argument has the C type the kernel
declares.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cuda.bindings import driver as cu
from cuda.core import Device, Kernel, LaunchConfig, ObjectCode, launch

from atlas.adapters.cuda.compiler import KernelCompiler, packaged_cubins
from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.memory import (
    BulkUploads,
    DeviceAllocation,
    DeviceMemoryPool,
    PinnedDownloads,
    PinnedMirror,
    PinnedStaging,
    free_pinned,
)
from atlas.adapters.cuda.registry import KernelModule, KernelTarget, arch_family, nvrtc_arch, select_modules
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.adapters.cuda.tma import TensorMap, parameter_array
from atlas.adapters.cuda.upload_ring import upload_threads
from atlas.ports.gpu import DType
from atlas.ports.startup import report_phase

log = logging.getLogger("atlas.cuda")


class CaptureError(RuntimeError):
    """Something a captured graph cannot hold was asked for while capturing."""


FEATURES_ENVIRONMENT = "ATLAS_CUDA_DISABLE"


@dataclass(frozen=True, slots=True)
class CudaFeatures:
    """Optional speed paths, each on where the device has it. `ATLAS_CUDA_DISABLE` (a comma list
    of `pdl`, `wgmma`, `gemm_tuning`, `gemv_fused`, `gemv_rope`, `mma_decode`, `rms_after_product`,
    `launch_order`, `moe_wgmma`, `moe_local_route`, `bulk_upload`, `file_reads`, `prefill_split`, `allreduce_ll`,
    `gemv_narrow`, `hbm_tuning`, `fp8_gemv_norm`, `fp8_fast_accum`, `cascade_attention`,
    `piecewise_graphs`, `cluster_merge`) turns some off, for debugging and A/B timings.

    programmatic_launch: kernels launch with programmatic stream serialization (sm_90+), so a
        kernel's launch overlaps the previous one's tail (every kernel waits in its entry,
        atlas_common.cuh).
    wgmma_attention: prefill attention through the wgmma kernels where the loaded module has them.
    prefill_split: a step of a few query tokens over long contexts runs the wgmma prefill
        kernel's `_split` twin (ops_attention.prefill_split_count), several blocks a tile.
    gemm_tuning: cuBLASLt times its top algorithms once per shape and keeps the fastest.
    hbm_tuning: with gemm_tuning, a weight smaller than the L2 is timed after an L2 eviction
        (`evict_l2`), as a decode step streams it from HBM, and races the tile variants as larger
        weights do (cublaslt.py); off, its candidates race from the L2 without those variants.
    fp8_gemv_norm: a one-token product over FP8 weights with an input norm normalises inside the
        GEMV (gemv_fp8.cu) instead of running the norm kernel before it.
    fp8_fast_accum: cuBLASLt's FP8 products over per-channel scales accumulate without fp32
        promotion (FAST_ACCUM, cublaslt.py); block-scaled ones always promote.
    batch_invariant: off by default and not in `ATLAS_CUDA_DISABLE`: the engine's
        `--batch-invariant` turns it on. A token row's bits then do not depend on how many rows
        its step has, up to the GEMV sizes (8 rows): bf16 and FP8 products of 1..8 rows all take
        the tensor-core GEMV (each token is its own mma column, the k order is the kernel's), no
        one-row-only fusion runs (the RoPE epilogue, the 2-warp narrow blocks, the FP8 norm
        inside the GEMV), and decode attention takes the warps and the split count a lone
        sequence would, so a row's splits are its own context's. A batch-1 step and a verify
        step of k <= 7 drafts then agree bit for bit, and greedy output with a proposer is the
        output without one.
    gemv_fused: at decode sizes the dense kind's `project` (a norm, a gated activation) and
        `project_add` are each one GEMV (the norm taken as x is loaded, or after the product where
        `fold_rmsnorm` folded its weight at `prepare`; the activation or residual add applied to
        the block's own rows).
    gemv_narrow: a one-token SIMT GEMV of 4 rows a block over K of 1025..2048 (plain, add, norm
        inside) runs blocks of 2 warps, twice as many an SM (gemv.cu's gemv_impl), where that
        brings its grid from two waves into one (`ops_dense._narrow_warps`).
    gemv_rope: a one-token attention `project` on rows up to 2048 wide is one GEMV that also
        rotates q and k and writes the cache (needs gemv_fused too).
    mma_decode: decode attention on tensor cores (mma.sync; the SIMT kernel without it).
    cluster_merge: a tensor-core decode attention of 2..8 splits (sm_90+) runs each sequence's
        splits of a head group as one cluster that merges them through distributed shared
        memory (a cluster barrier), instead of partials in global memory that the last split to
        finish merges after a fence and a counter (attention_decode.cu `merge_cluster`); not for
        cascaded layers.
    cascade_attention: decode rows that share a prefix (`AttentionMetadata.shared_prefix`) read
        it once for all of them (attention_cascade_* then the decode kernel's `_cascade` twin,
        attention_decode.cu; bf16 or FP8 caches, the `_x` extras too) for layers without a window; needs
        mma_decode, and batch_invariant turns it off (a row's sums would depend on its step).
    piecewise_graphs: steps with prompt tokens of up to the worker's limit replay their layers as
        graphs captured per token bucket, with attention launched eagerly between them
        (`capture_pieces`; `Capabilities.piecewise_graphs`); batch_invariant turns it off (a
        padded bucket's products would take other kernels than the step's own size).
    whole_prompts: with piecewise_graphs, a lone sequence's prompt step over a context of at most
        `ops_attention.WHOLE_PROMPT_MAX_KEYS` keys replays its layers captured whole, attention
        inside (`Capabilities.whole_prompt_keys`): one replay, not a launch and a piece a layer.
    rms_after_product: past the GEMV sizes, a norm folded into its projection (`fold_rmsnorm`)
        runs no norm kernel: the projection reads the residual as it is and the kernel after the
        product scales each token's row by its inverse RMS (RoPE + cache write after qkv, act_mul
        after gate_up), while the output projections add into the residual inside the GEMM
        (cuBLASLt's beta = 1, or the skinny GEMM's add form). Off, they take a product and an
        add kernel.
    launch_order_edges: in a captured graph, a kernel of ours after one launched without
        programmatic serialization (cuBLASLt's) launches once that kernel's blocks have all
        started and runs what precedes its griddepcontrol.wait beside it (graphs.py
        `launch_after_start`); needs programmatic_launch.
    moe_wgmma: the MoE experts' grouped GEMM (prefill sizes) on wgmma where the loaded module has
        it (kernels/sm90/moe.cu); off: the mma.sync kernels.
    moe_local_route: at one token the routing kernel stops after the logits and the expert
        kernels' blocks route the token themselves (moe.cuh `LocalRoute`), taking the routing
        kernel's last block off the step's chain; off: that last block writes the slot table.
    moe_ring: one token's routed experts (bf16, SiLU, no shared expert) as one persistent kernel
        on Hopper (`moe_ring_silu`, kernels/sm90/moe.cu: down's rows stream while gate_up still
        runs); off: moe_gate_up, then moe_down.
    skinny_gemm: 9..64 token rows of bf16 `linear` (and its gated and residual-add forms) go
        through our own skinny tensor-core GEMM on Hopper (`gemm_skinny_*`, gemv.cu: TMA into a
        warp-specialised ring, K split over clusters that reduce through distributed shared
        memory) instead of cuBLASLt. Off by default: on an H200 the Llama-3.1-8B step is 40 us
        faster with it at batch 16 and 150 us slower at batch 64 (docs/cuda-notes.md run 20); the tests,
        `benchmarks/cuda/bench_kernels.py` and `benchmarks/cuda/ablate_model_step.py gemm` turn it
        on to keep it correct and measured.
    bulk_upload: uploads larger than a staging slot (the weights at load) go through
        `BulkUploads` (upload_ring.py), a ring of page-locked slots filled by up to 12 threads
        (a memory-mapped checkpoint's tensors read from the file with preadv) while the earlier
        slots' DMAs run, instead of the driver's pageable copy.
    allreduce_ll: the P2P all-reduce takes its smallest messages with the LL kernels (a flag
        beside every 4 bytes pushed to each peer, no barrier; custom_allreduce.AllReduceSizes).
    file_reads: with bulk_upload, a memory-mapped checkpoint's tensors are read from their
        files with preadv into the slots, and such an upload is only queued on return so the
        threads read across tensors (the stream's users flush it first); off: copied out of
        the map (a fault per page not yet mapped), one tensor at a time, for the A/B.
    """

    programmatic_launch: bool = True
    wgmma_attention: bool = True
    prefill_split: bool = True
    gemm_tuning: bool = True
    gemv_fused: bool = True
    gemv_rope: bool = True
    gemv_narrow: bool = True
    mma_decode: bool = True
    rms_after_product: bool = True
    launch_order_edges: bool = True
    moe_wgmma: bool = True
    moe_local_route: bool = True
    moe_ring: bool = True
    skinny_gemm: bool = False
    bulk_upload: bool = True
    file_reads: bool = True
    allreduce_ll: bool = True
    hbm_tuning: bool = True
    fp8_gemv_norm: bool = True
    fp8_fast_accum: bool = True
    cascade_attention: bool = True
    cluster_merge: bool = True
    piecewise_graphs: bool = True
    whole_prompts: bool = True
    batch_invariant: bool = False

    @classmethod
    def for_device(cls, compute_capability: tuple[int, int]) -> CudaFeatures:
        """The defaults for a device, minus whatever the environment disables. Raises
        `ValueError` naming an unknown entry of `ATLAS_CUDA_DISABLE`."""
        disabled = {item.strip() for item in os.environ.get(FEATURES_ENVIRONMENT, "").split(",") if item.strip()}
        known = _SAME_NAMED_FEATURES + ("pdl", "wgmma", "launch_order", "cluster_merge")
        unknown = disabled - set(known)
        if unknown:
            raise ValueError(f"{FEATURES_ENVIRONMENT}: unknown {sorted(unknown)} (known: {', '.join(known)})")
        hopper_or_later = compute_capability[0] >= 9
        programmatic = hopper_or_later and "pdl" not in disabled and _launch_config_has_pdl()
        return cls(
            programmatic_launch=programmatic,
            wgmma_attention="wgmma" not in disabled,
            launch_order_edges=programmatic and "launch_order" not in disabled,
            cluster_merge=hopper_or_later and "cluster_merge" not in disabled,
            **{name: name not in disabled for name in _SAME_NAMED_FEATURES},
        )


# The features that `ATLAS_CUDA_DISABLE` names as their field is named, on by default on every device.
_SAME_NAMED_FEATURES = (
    "prefill_split",
    "gemm_tuning",
    "gemv_fused",
    "gemv_rope",
    "gemv_narrow",
    "mma_decode",
    "rms_after_product",
    "moe_wgmma",
    "moe_local_route",
    "moe_ring",
    "bulk_upload",
    "file_reads",
    "allreduce_ll",
    "hbm_tuning",
    "fp8_gemv_norm",
    "fp8_fast_accum",
    "cascade_attention",
    "piecewise_graphs",
    "whole_prompts",
)


def _cluster_shape(cluster: int | tuple[int, int, int]) -> tuple[int, int, int]:
    """`launch`'s cluster argument as (x, y, z): an int is that many blocks along x."""
    return (cluster, 1, 1) if isinstance(cluster, int) else cluster


def _launch_config_has_pdl() -> bool:
    try:
        LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
    except TypeError:  # a cuda.core without the field: launch without PDL
        return False
    return True


class KernelLibrary:
    """The selected modules of one target: their cubins fetched in the background (packaged,
    cached, or compiled by NVRTC on a pool of threads) and loaded on first use.

    Construction returns at once, so weights load while NVRTC compiles; `get` waits for its
    module only. When every module is in, one `kernels` startup phase is logged; each module
    NVRTC compiles is logged as it finishes (a cold start's progress). A module that failed to
    compile raises its `KernelCompileError` from `get` (and from `wait`).
    """

    def __init__(self, modules: dict[str, KernelModule], compiler: KernelCompiler) -> None:
        self.modules = modules
        self.compiler = compiler
        self._started = time.perf_counter()
        self._objects: dict[str, ObjectCode] = {}
        self._kernels: dict[tuple[str, str], Kernel] = {}
        self._lock = threading.Lock()
        self._num_done = 0
        workers = max(1, min(len(modules), os.cpu_count() or 1, 8))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="atlas-kernels")
        self._cubins = {name: self._pool.submit(self._fetch, module) for name, module in modules.items()}
        self._pool.shutdown(wait=False)  # the threads exit once the last module is in

    def _fetch(self, module: KernelModule) -> bytes:
        started = time.perf_counter()
        num_compiled = len(self.compiler.stats.compiled)
        data = self.compiler.cubin(module)
        with self._lock:
            self._num_done += 1
            done = self._num_done
        if len(self.compiler.stats.compiled) > num_compiled:
            log.info("NVRTC compiled %s for %s in %.1f s (%d of %d modules ready)",
                     module.name, self.compiler.arch, time.perf_counter() - started, done, len(self.modules))
        if done == len(self.modules):
            report_phase("kernels", time.perf_counter() - self._started,
                         f"{self.compiler.arch}, {len(self.modules)} modules: {self.compiler.stats.describe()}")
        return data

    def wait(self) -> None:
        """Block until every module's cubin is in; raises the first compile error."""
        for future in self._cubins.values():
            future.result()

    def cancel(self) -> None:
        """Drop the modules not started yet (a backend closed during a cold start)."""
        for future in self._cubins.values():
            future.cancel()

    def provides(self, module: str, symbol: str) -> bool:
        """Whether the loaded `module` defines `symbol` (a tuned module may add kernels)."""
        try:
            self.get(module, symbol)
        except KeyError:
            return False
        return True

    def get(self, module: str, symbol: str) -> Kernel:
        """The kernel `symbol` of `module`; `KeyError` naming both when either is missing."""
        key = (module, symbol)
        kernel = self._kernels.get(key)
        if kernel is None:
            source = self.modules.get(module)
            if source is None:
                raise KeyError(f"no kernel module {module!r} (have {sorted(self.modules)})")
            code = self._objects.get(module)
            if code is None:
                code = self._objects[module] = ObjectCode.from_cubin(self._cubins[module].result(), name=module)
            try:
                kernel = code.get_kernel(symbol)
            except Exception as error:
                raise KeyError(f"kernel {symbol!r} is not defined by {source.source_path}") from error
            self._kernels[key] = kernel
        return kernel


class CudaRuntime:
    """Device, stream, memory and kernels of one `CudaGpuBackend`."""

    def __init__(
        self,
        device_ordinal: int,
        kernel_cache_dir: Path | None,
        model_hint: str | None,
        quant: str,
    ) -> None:
        started = time.perf_counter()
        self.device = Device(device_ordinal)
        self.device.set_current()
        self._current = threading.local()  # `current`: the device's context is current on this thread
        self._current.current = True
        capability = self.device.compute_capability
        self.compute_capability = (int(capability.major), int(capability.minor))
        self.arch = nvrtc_arch(self.compute_capability)
        properties = self.device.properties
        self.num_sms = int(properties.multiprocessor_count)
        self.max_shared_optin = int(properties.max_shared_memory_per_block_optin)
        self.max_shared_per_sm = int(properties.max_shared_memory_per_multiprocessor)
        self.l2_bytes = int(properties.l2_cache_size)
        # Peak DRAM bytes/s (double data rate over the bus), 0 where the driver does not say.
        try:
            bus_bytes = int(properties.global_memory_bus_width) // 8
            self.peak_bandwidth = 2 * int(properties.memory_clock_rate) * 1000 * bus_bytes
        except Exception:  # noqa: BLE001 - an attribute a driver dropped: the choices keyed on it take their defaults
            self.peak_bandwidth = 0
        self.device_name = str(self.device.name)
        self._stream = self.device.create_stream()
        self._stream_handle = int(self._stream.handle)
        self.pool = DeviceMemoryPool(f"device {device_ordinal} ({self.device_name})")
        self._closed = False
        self.features = CudaFeatures.for_device(self.compute_capability)
        bulk = None
        if self.features.bulk_upload:
            bulk = BulkUploads(self._stream_handle, num_threads=upload_threads(), read_files=self.features.file_reads)
        self.staging = PinnedStaging(self._stream_handle, bulk=bulk)
        self.downloads = PinnedDownloads(self._stream_handle, make_current=self.ensure_current)
        self._mirrors: weakref.WeakSet[PinnedMirror] = weakref.WeakSet()
        self._retired_mirrors: list[tuple[int, object]] = []  # garbage mirrors' memory, freed by host_mirror
        self._reported_ring_bytes = 0
        driver_cuda = int(check("cuDriverGetVersion", cu.cuDriverGetVersion()))
        report_phase("cuda context", time.perf_counter() - started,
                     f"{self.device_name}, driver CUDA {driver_cuda // 1000}.{driver_cuda % 1000 // 10}")
        target = KernelTarget(arch_family(self.compute_capability), model_hint or "any", quant)
        self.target = target
        compiler = KernelCompiler(self.arch, kernel_cache_dir, packaged_cubins(self.arch, driver_cuda))
        self.kernels = KernelLibrary(select_modules(target), compiler)
        self.capturing = False
        self._workspaces: dict[str, DeviceAllocation] = {}
        self._retired_workspaces: list[DeviceAllocation] = []
        self._shared_limits: dict[tuple[str, str], int] = {}
        self._configs: dict[tuple, LaunchConfig] = {}
        self._functions: dict[tuple[str, str], cu.CUfunction] = {}  # for cuLaunchKernelEx
        self._cluster_blocks: dict[tuple, int] = {}

    # -- context ---------------------------------------------------------------------------
    def ensure_current(self) -> None:
        """Make the device's context current on a thread that drives the backend for the first
        time. A context stays current on its thread, so the engine thread and the engine's mask
        thread (which waits for a step's ids) each set it once, not at every turn; a flag local
        to the thread, as a finished thread's ident may be reused by a new one."""
        current = self._current
        if not getattr(current, "current", False):
            self.device.set_current()
            current.current = True

    # -- the stream ------------------------------------------------------------------------
    # An upload read from a checkpoint's files is only queued when `copy_from_host` returns
    # (upload_ring.py), so the next tensor's reads overlap this one's. Whatever is enqueued
    # after it must come after its DMAs: every op takes the stream from here (or `launch`),
    # and that first puts the queued uploads on it. cuBLASLt keeps the handle it was given,
    # so the GEMM wrappers call `flush_uploads` before each product.
    def flush_uploads(self) -> None:
        """Enqueue every queued upload on the stream (for work that holds its handle)."""
        if self.staging.queued:
            self.staging.flush()

    @property
    def stream(self):
        """The cuda.core stream, with every queued upload enqueued on it."""
        if self.staging.queued:
            self.staging.flush()
        return self._stream

    @property
    def stream_handle(self) -> int:
        """The stream's driver handle, with every queued upload enqueued on it."""
        if self.staging.queued:
            self.staging.flush()
        return self._stream_handle

    def host_mirror(self, device_address: int, shape: tuple[int, ...], dtype: np.dtype) -> PinnedMirror:
        """Page-locked rows mirroring the device buffer at `device_address` (memory.PinnedMirror);
        the memory of mirrors gone since is freed first."""
        self.ensure_current()
        self.forbid_in_capture("host_mirror")
        free_pinned(self._retired_mirrors)
        mirror = PinnedMirror(device_address, shape, dtype, self._copy_to_device, self._retired_mirrors,
                              self.ensure_current)
        self._mirrors.add(mirror)
        return mirror

    def _copy_to_device(self, device_address: int, host_address: int, num_bytes: int, event: object) -> None:
        """Enqueue a copy from page-locked memory behind any queued bulk upload, then record
        `event` (while capturing, as an event node: a replay records it too)."""
        self.ensure_current()
        stream = self.stream_handle
        check("cuMemcpyHtoDAsync", cu.cuMemcpyHtoDAsync(device_address, host_address, num_bytes, stream))
        if self.capturing:
            flags = cu.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL
            check("cuEventRecordWithFlags", cu.cuEventRecordWithFlags(event, stream, flags))
        else:
            check("cuEventRecord", cu.cuEventRecord(event, stream))

    def forbid_in_capture(self, what: str) -> None:
        if self.capturing:
            raise CaptureError(f"{what} cannot run while a CUDA graph is being captured")

    # -- launches --------------------------------------------------------------------------
    def launch(
        self,
        module: str,
        symbol: str,
        grid: tuple[int, ...],
        block: int,
        *args: object,
        shared_bytes: int = 0,
        cluster: int | tuple[int, int, int] = 1,
    ) -> None:
        """Enqueue `symbol` of `module` on the stream (with programmatic stream serialization
        when `features.programmatic_launch` is on), in clusters of `cluster` blocks along x (or
        of the (x, y, z) shape `cluster` gives)."""
        self.ensure_current()
        if self.staging.queued:
            self.staging.flush()
        kernel = self.kernels.get(module, symbol)
        if shared_bytes > 48 * 1024:
            self._raise_shared_limit(module, symbol, kernel, shared_bytes)
        programmatic = self.features.programmatic_launch
        if _cluster_shape(cluster) != (1, 1, 1) or any(isinstance(arg, TensorMap) for arg in args):
            config = self._driver_config(grid, block, shared_bytes, cluster)
            pointers, _kept = parameter_array(args)  # `_kept` holds what `pointers` points to
            function = self._function(module, symbol, kernel)
            check("cuLaunchKernelEx", cu.cuLaunchKernelEx(config, function, ctypes.addressof(pointers), 0))
            return
        key = (grid, block, shared_bytes, programmatic)
        config = self._configs.get(key)
        if config is None:
            if programmatic:
                config = LaunchConfig(
                    grid=grid, block=block, shmem_size=shared_bytes, programmatic_stream_serialization=True
                )
            else:
                config = LaunchConfig(grid=grid, block=block, shmem_size=shared_bytes)
            self._configs[key] = config
        launch(self._stream, config, kernel, *args)

    def _driver_config(
        self, grid: tuple[int, ...], block: int, shared_bytes: int, cluster: int | tuple[int, int, int]
    ) -> cu.CUlaunchConfig:
        """cuLaunchKernelEx's config for launches cuda.core cannot make (tensor maps by value,
        tma.py) or that need the driver's own call (the cluster query): the same attributes."""
        config = cu.CUlaunchConfig()
        dims = (*grid, 1, 1)
        config.gridDimX, config.gridDimY, config.gridDimZ = dims[:3]
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = shared_bytes
        config.hStream = cu.CUstream(self.stream_handle)
        attributes = []
        if self.features.programmatic_launch:
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attribute.value.programmaticStreamSerializationAllowed = 1
            attributes.append(attribute)
        shape = _cluster_shape(cluster)
        if shape != (1, 1, 1):
            attribute = cu.CUlaunchAttribute()
            attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = shape
            attributes.append(attribute)
        config.attrs = attributes
        config.numAttrs = len(attributes)
        return config

    def _function(self, module: str, symbol: str, kernel: Kernel) -> cu.CUfunction:
        function = self._functions.get((module, symbol))
        if function is None:
            function = check("cuKernelGetFunction", cu.cuKernelGetFunction(kernel.handle))
            self._functions[(module, symbol)] = function
        return function

    def cluster_blocks(self, module: str, symbol: str, block: int, shared_bytes: int, cluster: int) -> int:
        """How many blocks of `symbol` the GPU holds at once in clusters of `cluster` (a cluster's
        blocks share one GPC, so GPCs whose SM count `cluster` does not divide leave SMs over)."""
        key = (module, symbol, shared_bytes, cluster)
        blocks = self._cluster_blocks.get(key)
        if blocks is None:
            self.ensure_current()
            kernel = self.kernels.get(module, symbol)
            if shared_bytes > 48 * 1024:
                self._raise_shared_limit(module, symbol, kernel, shared_bytes)
            config = self._driver_config((cluster,), block, shared_bytes, cluster)
            function = self._function(module, symbol, kernel)
            clusters = check("cuOccupancyMaxActiveClusters", cu.cuOccupancyMaxActiveClusters(function, config))
            blocks = self._cluster_blocks[key] = int(clusters) * cluster
        return blocks

    def _raise_shared_limit(self, module: str, symbol: str, kernel: Kernel, shared_bytes: int) -> None:
        if self._shared_limits.get((module, symbol), 0) >= shared_bytes:
            return
        if shared_bytes > self.max_shared_optin:
            raise ValueError(
                f"{symbol} needs {shared_bytes} bytes of shared memory; "
                f"{self.device_name} allows {self.max_shared_optin}"
            )
        attribute = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(
            "cuKernelSetAttribute",
            cu.cuKernelSetAttribute(attribute, shared_bytes, kernel.handle, self.device.device_id),
        )
        self._shared_limits[(module, symbol)] = shared_bytes

    # -- memory ----------------------------------------------------------------------------
    def workspace(self, name: str, num_bytes: int) -> int:
        """Address of a persistent scratch buffer of at least `num_bytes`, grown on demand.

        A buffer that is outgrown is retired, never freed: a graph captured earlier still
        writes to it on replay. Growth doubles, so the retired ones add at most the size of
        the current one. Growing during graph capture is fine (capture is in relaxed mode and
        an allocation is no stream operation): the graph keeps the new buffer.
        """
        current = self._workspaces.get(name)
        if current is not None and current.num_bytes >= num_bytes:
            return current.address
        if current is not None:
            self._retired_workspaces.append(current)
            num_bytes = max(num_bytes, 2 * current.num_bytes)
        allocation = self.pool.allocate(max(num_bytes, 1))
        self._workspaces[name] = allocation
        return allocation.address

    def scratch_tensor(self, name: str, shape: tuple[int, ...], dtype: DType) -> CudaTensor:
        """A tensor of `shape` over workspace `name`: where a member keeps an intermediate that
        its fused kernels may skip (a norm's output, a product before its epilogue)."""
        return CudaTensor(self.workspace(name, math.prod(shape) * dtype.itemsize), tuple(shape), dtype, self)

    def evict_l2(self) -> None:
        """Enqueue reads of twice the L2's bytes of a workspace of its own (allocated at the first
        call), so that the next kernel finds none of its operands in the L2: the GEMM tuner's
        races of a weight smaller than the L2 (cublaslt.py), which a decode step streams from HBM
        but back-to-back replays would serve from the L2."""
        words = 2 * max(self.l2_bytes, 1 << 20) // 16
        data = self.workspace("l2_eviction", 16 * words + 16)
        self.launch("elementwise", "read_through_l2", (4 * self.num_sms,), 512, data, np.int64(words),
                    np.uint32(0x9E3779B9), data + 16 * words)

    def counters(self, name: str, count: int) -> int:
        """Address of `count` u32 counters, all zero, for kernels whose last block to finish does
        the grid's closing step (`last_block_done` in atlas_common.cuh); each such block puts its
        counter back to zero. A new or grown buffer is zeroed on the stream, ahead of the launch
        that uses it (inside a capture, as a node of the graph)."""
        num_bytes = 4 * max(count, 1)
        current = self._workspaces.get(name)
        address = self.workspace(name, num_bytes)
        if current is None or current.address != address:
            grown = self._workspaces[name]
            check("cuMemsetD32Async", cu.cuMemsetD32Async(address, 0, grown.num_bytes // 4, self.stream_handle))
        return address

    def synchronize(self) -> None:
        self.ensure_current()
        check("cuStreamSynchronize", cu.cuStreamSynchronize(self.stream_handle))
        stats = self.staging.bulk_stats
        if stats is not None and stats.num_bytes > self._reported_ring_bytes:  # the weights are in
            self._reported_ring_bytes = stats.num_bytes
            log.info("upload ring: %s", stats.describe())

    def memory_info(self) -> tuple[int, int]:
        self.ensure_current()
        free, total = check("cuMemGetInfo", cu.cuMemGetInfo())
        return int(free) + self.pool.stats().cached_bytes, int(total)

    def close(self) -> None:
        """Free the device memory, staging buffers and workspaces (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self.kernels.cancel()
        self._workspaces.clear()
        self._retired_workspaces.clear()
        self.synchronize()
        self.staging.close()
        self.downloads.close()
        for mirror in list(self._mirrors):
            mirror.retire()
        free_pinned(self._retired_mirrors)
        self.pool.close()
