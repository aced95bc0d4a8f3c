"""The recurrent kind on CUDA: Gated DeltaNet's state slots, causal conv1d and gated delta rule
(kernels/common/gated_delta.cu).

State layout (one allocation; per layer, the conv states of every slot, then the recurrent ones):

    layer l:  conv [num_slots][K - 1][conv_dim] f32  |  recurrent [num_slots][Hv][dk][dv] f32

The same kernels serve prompts and decodes: a block per (32 value columns, head, sequence)
walks its sequence's tokens with its slice of S in registers (see the kernel file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.memory import DeviceAllocation
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.ports.gpu import DType, UnsupportedError
from atlas.ports.kernels.recurrent import DeltaNetLayer, HostDeltaNet, RecurrentMetadata, RecurrentStateSpec

MAX_KEY_DIM = 128  # gated_delta.cu GDN_MAX_KEY_DIM: a thread holds dk / 4 rows of a column
MAX_CONV_KERNEL = 8
_COLUMNS = 32
_CONV_THREADS = 64


class CudaRecurrentState:
    """The state slots of a cache group on the device (layout in the module docstring)."""

    __slots__ = ("_spec", "_allocation")

    def __init__(self, spec: RecurrentStateSpec, allocation: DeviceAllocation) -> None:
        self._spec = spec
        self._allocation = allocation

    @property
    def spec(self) -> RecurrentStateSpec:
        return self._spec

    @property
    def _layer_bytes(self) -> int:
        return self._spec.bytes_per_slot // self._spec.num_layers * self._spec.num_slots

    def conv_plane(self, layer: int) -> int:
        return self._allocation.address + layer * self._layer_bytes

    def recurrent_plane(self, layer: int) -> int:
        spec = self._spec
        conv_bytes = spec.num_slots * (spec.conv_kernel - 1) * spec.conv_dim * 4
        return self.conv_plane(layer) + conv_bytes


@dataclass(frozen=True, slots=True)
class CudaDeltaNetLayer:
    layer: DeltaNetLayer
    conv_weight: object  # CudaTensor [conv_dim, K] f32
    decay_rate: object  # [Hv] f32: exp(a_log)
    dt_bias: object  # [Hv] f32
    norm: object  # [dv] bf16
    eps: float


class CudaRecurrent:
    """`RecurrentKernels` on one GPU."""

    def __init__(self, rt: CudaRuntime, upload) -> None:
        self._rt = rt
        self._upload = upload

    def allocate_state(self, spec: RecurrentStateSpec) -> CudaRecurrentState:
        rt = self._rt
        rt.ensure_current()
        rt.forbid_in_capture("allocate_state")
        if spec.dtype is not DType.F32:
            raise ValueError(f"spec.dtype: the CUDA backend keeps recurrent state in f32, not {spec.dtype.value}")
        total = spec.num_slots * spec.bytes_per_slot
        try:
            allocation = rt.pool.allocate(max(total, 1))
        except MemoryError as error:
            free, _ = rt.memory_info()
            raise MemoryError(
                f"{spec.num_slots} recurrent state slots need {total / 2**30:.2f} GiB; {free / 2**30:.2f} GiB free "
                f"holds {free // spec.bytes_per_slot} slots ({error})"
            ) from error
        return CudaRecurrentState(spec, allocation)

    def prepare(self, host: HostDeltaNet, layer: DeltaNetLayer) -> CudaDeltaNetLayer:
        heads = layer.num_value_heads
        if heads % layer.num_key_heads:
            raise ValueError(f"layer: {heads} value heads do not divide over {layer.num_key_heads} key heads")
        if np.shape(host.conv_weight) != (layer.conv_dim, layer.conv_kernel):
            expected = [layer.conv_dim, layer.conv_kernel]
            raise ValueError(f"conv_weight: shape {np.shape(host.conv_weight)} is not {expected}")
        for name, values in (("a_log", host.a_log), ("dt_bias", host.dt_bias)):
            if np.shape(values) != (heads,):
                raise ValueError(f"{name}: shape {np.shape(values)} is not [{heads}]")
        if np.shape(host.norm.weight) != (layer.value_head_dim,):
            raise ValueError(f"norm: shape {np.shape(host.norm.weight)} is not [{layer.value_head_dim}]")
        if layer.key_head_dim > MAX_KEY_DIM:
            raise UnsupportedError(f"key_head_dim: {layer.key_head_dim} is over the CUDA kernel's {MAX_KEY_DIM}")
        if not 1 <= layer.conv_kernel <= MAX_CONV_KERNEL:
            raise UnsupportedError(
                f"conv_kernel: {layer.conv_kernel} is outside the CUDA kernel's 1..{MAX_CONV_KERNEL}"
            )
        upload = self._upload
        return CudaDeltaNetLayer(
            layer,
            upload(np.asarray(host.conv_weight, np.float32), DType.F32),
            upload(np.exp(np.asarray(host.a_log, np.float32)), DType.F32),
            upload(np.asarray(host.dt_bias, np.float32), DType.F32),
            upload(np.asarray(host.norm.weight, np.float32), DType.BF16),
            host.norm.eps,
        )

    def _meta(self, meta: RecurrentMetadata) -> tuple[int, int, int]:
        for name, tensor in (("query_start_loc", meta.query_start_loc), ("seq_lens", meta.seq_lens),
                             ("state_slots", meta.state_slots)):
            checks.dtype(tensor, f"meta.{name}", (DType.I32,))
        checks.at_least_rows(meta.query_start_loc, "meta.query_start_loc", meta.num_seqs + 1)
        checks.at_least_rows(meta.seq_lens, "meta.seq_lens", meta.num_seqs)
        checks.at_least_rows(meta.state_slots, "meta.state_slots", meta.num_seqs)
        return (
            checks.address(meta.query_start_loc, "meta.query_start_loc"),
            checks.address(meta.seq_lens, "meta.seq_lens"),
            checks.address(meta.state_slots, "meta.state_slots"),
        )

    @staticmethod
    def _snapshots(meta: RecurrentMetadata) -> tuple[int, np.int32]:
        """The kernels' (snapshots, width) arguments: `meta.snapshot_slots` [S, W] i32, or none."""
        snapshots = meta.snapshot_slots
        if snapshots is None:
            return 0, np.int32(0)
        checks.dtype(snapshots, "meta.snapshot_slots", (DType.I32,))
        if len(snapshots.shape) != 2 or snapshots.shape[0] < meta.num_seqs:
            raise ValueError(f"meta.snapshot_slots {list(snapshots.shape)}: not [>= {meta.num_seqs}, W]")
        return checks.address(snapshots, "meta.snapshot_slots"), np.int32(snapshots.shape[1])

    @staticmethod
    def _state(state: object, layer: DeltaNetLayer) -> CudaRecurrentState:
        if not isinstance(state, CudaRecurrentState):
            raise ValueError(f"state: expected a CudaRecurrentState, got {type(state).__name__}")
        spec = state.spec
        fits = (spec.conv_dim, spec.conv_kernel, spec.num_heads, spec.key_dim, spec.value_dim) == (
            layer.conv_dim, layer.conv_kernel, layer.num_value_heads, layer.key_head_dim, layer.value_head_dim)
        if not fits or layer.state_layer >= spec.num_layers:
            raise ValueError(f"state: its spec {spec} does not hold layer {layer}")
        return state

    def causal_conv1d(
        self, projected, layer: CudaDeltaNetLayer, meta: RecurrentMetadata, state, out
    ) -> None:
        shape = layer.layer
        slots = self._state(state, shape)
        tokens = meta.num_tokens
        checks.dtype(projected, "projected", (DType.BF16,))
        checks.dtype(out, "out", (DType.BF16,))
        if projected.shape != (tokens, shape.projected_width) or out.shape != (tokens, shape.conv_dim):
            raise ValueError(f"projected {list(projected.shape)} / out {list(out.shape)}: not "
                             f"[N, {shape.projected_width}] / [N, {shape.conv_dim}]")
        metadata = self._meta(meta)
        if tokens == 0 or meta.num_seqs == 0:
            return
        self._rt.launch(
            "gated_delta", "causal_conv1d", (-(-shape.conv_dim // _CONV_THREADS), meta.num_seqs), _CONV_THREADS,
            projected.address, np.int32(shape.projected_width), layer.conv_weight.address, *metadata,
            slots.conv_plane(shape.state_layer), out.address, np.int32(shape.conv_dim), np.int32(shape.conv_kernel),
            *self._snapshots(meta),
        )

    def gated_delta_rule(
        self, mixed, projected, layer: CudaDeltaNetLayer, meta: RecurrentMetadata, state, out
    ) -> None:
        rt, shape = self._rt, layer.layer
        slots = self._state(state, shape)
        tokens = meta.num_tokens
        checks.dtype(mixed, "mixed", (DType.BF16,))
        checks.dtype(projected, "projected", (DType.BF16,))
        checks.dtype(out, "out", (DType.BF16,))
        checks.shape(mixed, "mixed", (tokens, shape.conv_dim))
        checks.shape(projected, "projected", (tokens, shape.projected_width))
        checks.shape(out, "out", (tokens, shape.value_dim))
        metadata = self._meta(meta)
        if tokens == 0 or meta.num_seqs == 0:
            return
        heads, value_dim = shape.num_value_heads, shape.value_head_dim
        core = rt.workspace("gdn_core", tokens * shape.value_dim * 4)
        # Decode steps take the gated norm in the rule's last block per head (one launch less).
        fused = meta.max_query_len == 1
        counters = rt.counters("gdn_counters", meta.num_seqs * heads) if fused else 0
        rt.launch(
            "gated_delta", "gated_delta_rule_d128" if shape.key_head_dim == MAX_KEY_DIM else "gated_delta_rule",
            (-(-value_dim // _COLUMNS), heads, meta.num_seqs), 128,
            mixed.address, projected.address, layer.decay_rate.address, layer.dt_bias.address, *metadata,
            slots.recurrent_plane(shape.state_layer), core, np.int32(shape.num_key_heads), np.int32(heads),
            np.int32(shape.key_head_dim), np.int32(value_dim), np.int32(shape.conv_dim),
            np.int32(shape.projected_width), np.int32(fused), layer.norm.address, np.float32(layer.eps),
            out.address, counters, *self._snapshots(meta),
        )
        if fused:
            return
        items = tokens * heads
        rt.launch(
            "gated_delta", "gdn_gated_norm", (math.ceil(items / 8),), 256,
            core, projected.address, layer.norm.address, np.float32(layer.eps), out.address, np.int32(tokens),
            np.int32(heads), np.int32(value_dim), np.int32(shape.conv_dim), np.int32(shape.projected_width),
        )
