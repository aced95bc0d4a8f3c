"""MoE launches (kernels/common/moe.cu): routing, the grouped experts and the combine.

Every grid is sized by host bounds (tokens, top_k, experts), never by the routing's outcome, so
a step is graph-capturable: the grouped GEMV's grid has a slot per possible active expert
(min(E, N k)) and the grouped GEMM's a tile per possible 64-row tile; blocks past what the step
routed leave at once.

E4M3 experts (`ExpertWeights.scales`) take the `_fp8` / `_fp8_blk` forms of the expert kernels
(per-channel / 128 x 128 block scales), each weight followed by its scales in the arguments: the
same grids, slot table and epilogues over half the bytes; at prefill the mma.sync grouped GEMM
widens each tile's E4M3 weights to bf16 in shared memory (no wgmma form yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import Activation, ClampedSwiglu, GatedActivation

MAX_EXPERTS = 512  # moe.cu MOE_MAX_EXPERTS: a warp routes a token with E / 32 scores a lane
MAX_TOP_K = 16
ROUTE_SMALL_MAX_TOKENS = 8  # moe_route_small: the decode routing in one launch
ROUTE_ROWS = 4
GEMV_MAX_TOKENS = 64  # the grouped GEMV (a slot's pairs in shared memory); past it the grouped GEMM
_SLOT_INTS = 2 + GEMV_MAX_TOKENS  # moe.cu MOE_SLOT_INTS: a slot table entry (expert, count, pairs)
_WARPS = 4  # moe.cu MOE_WARPS
_DOWN_ROWS = 16  # MOE_DOWN_ROWS: moe_down's rows a block
_DOWN_LOOPED_BLOCKS_PER_SM = 8  # MOE_DOWN_MIN_BLOCKS: moe_down_looped's grid is one wave
_GEMM_ROWS = 128  # moe.cu GEMM_BM / GEMM_BN (gate_up: 64 features a tile)
_GEMM_THREADS = 128
_GEMM_SHARED_BYTES = 3 * (128 + 128) * (32 + 8) * 2  # GEMM_SHARED_BYTES
_WGMMA_THREADS = 256  # kernels/sm90/moe.cu WG_GEMM_THREADS: two warpgroups
_WGMMA_SHARED_BYTES = 3 * 2 * 128 * 128 + 1024  # WG_GEMM_SHARED_BYTES: 3 stages of A and B panels + alignment
# GEMM_FP8_SHARED_BYTES: 3 stages of A (bf16) and of E4M3 B, and two widened bf16 B tiles
_GEMM_FP8_SHARED_BYTES = 3 * (128 * (32 + 8) * 2 + 128 * 32) + 2 * 128 * (32 + 8) * 2
FP8_ACTIVATIONS = ("silu",)  # the gated activations of the FP8 expert kernels (moe.cuh's *_fp8 forms)


@dataclass(frozen=True, slots=True)
class GatedKind:
    """The kernel-name suffix of a gated activation and its constants (alpha, limit)."""

    name: str
    alpha: float = 0.0
    limit: float = 0.0


def gated_kind(activation: GatedActivation) -> GatedKind:
    if isinstance(activation, ClampedSwiglu):
        return GatedKind("clamped", float(activation.alpha), float(activation.limit))
    return GatedKind({Activation.SILU: "silu", Activation.GELU_TANH: "gelu_tanh"}[activation])


@dataclass(frozen=True, slots=True)
class RoutingArgs:
    num_experts: int
    top_k: int
    sigmoid: bool
    renormalize: bool
    scaling: float
    selection_bias: CudaTensor | None  # [E] f32


@dataclass(frozen=True, slots=True)
class HeldExperts:
    """The routed experts this GPU holds: `count` of them from global id `first` on (an
    expert-parallel rank's share; all of them on one GPU)."""

    first: int
    count: int


def routed_slots(held: HeldExperts, num_tokens: int, top_k: int) -> int:
    """Grid slots of the grouped GEMV for routed experts: at most one per held expert and per pair."""
    return min(held.count, num_tokens * top_k)


def slot_table(rt: CudaRuntime, held: HeldExperts, num_tokens: int, top_k: int) -> int:
    """The slot table the routing writes for the grouped GEMV (moe.cu build_slot_table), or 0
    when the step's experts run on the grouped GEMM."""
    if num_tokens > GEMV_MAX_TOKENS:
        return 0
    return rt.workspace("moe_slot_table", routed_slots(held, num_tokens, top_k) * _SLOT_INTS * 4)


def _table_tail(rt: CudaRuntime, held: HeldExperts, num_tokens: int, top_k: int) -> tuple:
    return (slot_table(rt, held, num_tokens, top_k), np.int32(held.first), np.int32(held.count),
            np.int32(routed_slots(held, num_tokens, top_k)))


def routes_in_experts(rt: CudaRuntime, held: HeldExperts, num_tokens: int, top_k: int) -> bool:
    """Whether the expert kernels route the step's one token themselves from the logits
    (moe.cuh `LocalRoute`): the routing kernel then writes only the logits and `normed`, and the
    ids and weights are written by `experts`. Needs a routed slot per pair (slot j serves pair j)."""
    return num_tokens == 1 and rt.features.moe_local_route and routed_slots(held, num_tokens, top_k) == top_k


# moe_ring_silu (kernels/sm90/moe.cu): threads, and its ring's shared memory (3 stages of 32 KB
# and their barriers).
_RING_THREADS = 288
_RING_SHARED_BYTES = 3 * 32 * 1024 + 2 * 3 * 8
_RING_MAX_FEATURES, _RING_MAX_ROWS = 128, 32  # its RING_MAX_G and RING_MAX_D


def ring_applies(rt: CudaRuntime, weights: ExpertWeights, held: HeldExperts, num_tokens: int, top_k: int,
                 accumulate: bool) -> bool:
    """Whether one token's routed experts run as moe_ring_silu, one persistent kernel for
    moe_gate_up and moe_down: bf16 SiLU experts without biases or a shared expert, every expert
    held, hidden 2048 and inner a multiple of 256 up to 1024 (its tiling), top_k <= 16, the
    token routed in the experts (`routes_in_experts`), on Hopper (feature `moe_ring`; off under
    batch invariance, since a lone token would then sum otherwise than in a batch)."""
    blocks = rt.num_sms  # a block an SM: its share of gate_up's features and of the hidden rows must fit
    features, rows = -(-(top_k * weights.inner // 4) // blocks) * 4, -(-weights.hidden // blocks)
    return (rt.features.moe_ring and not rt.features.batch_invariant and accumulate
            and features <= _RING_MAX_FEATURES and rows <= _RING_MAX_ROWS
            and weights.scales is None and weights.activation.name == "silu"
            and weights.gate_up_bias is None and weights.down_bias is None and weights.shared_down is None
            and weights.first_expert == 0 and held.count == weights.num_experts
            and weights.hidden == 2048 and weights.inner % 256 == 0 and weights.inner <= 1024 and top_k <= 16
            and routes_in_experts(rt, held, num_tokens, top_k) and _RING_SHARED_BYTES <= rt.max_shared_optin
            and rt.kernels.provides("moe", "moe_ring_silu"))


def _logits(rt: CudaRuntime, num_tokens: int, num_experts: int) -> int:
    return rt.workspace("moe_logits", num_tokens * num_experts * 4)


def _local_route_args(rt: CudaRuntime, routing: RoutingArgs, local: bool) -> tuple:
    """moe.cuh MOE_LOCAL_ROUTE_PARAMS: the logits (0: the slot table is read) and the routing."""
    if not local:
        return (0, 0, np.int32(0), np.int32(0), np.int32(0), np.float32(1.0))
    return (_logits(rt, 1, routing.num_experts), _address(routing.selection_bias), np.int32(routing.num_experts),
            np.int32(routing.sigmoid), np.int32(routing.renormalize), np.float32(routing.scaling))


def _routing_tail(routing: RoutingArgs) -> tuple:
    return (
        np.int32(routing.num_experts),
        np.int32(routing.top_k),
        np.int32(routing.sigmoid),
        np.int32(routing.renormalize),
        np.float32(routing.scaling),
    )


def route_small(
    rt: CudaRuntime,
    x: CudaTensor,
    norm_weight: CudaTensor,
    eps: float,
    router: CudaTensor,
    router_bias: CudaTensor | None,
    routing: RoutingArgs,
    held: HeldExperts,
    normed: CudaTensor,
    expert_ids: CudaTensor,
    expert_weights: CudaTensor,
) -> None:
    """norm + router + top-k in one launch for up to ROUTE_SMALL_MAX_TOKENS tokens, and the
    grouped GEMV's slot table of the held experts; where `routes_in_experts`, only the norm and
    the logits (the experts route the token)."""
    num_tokens, hidden = x.shape
    experts = routing.num_experts
    logits = _logits(rt, num_tokens, experts)
    counter = rt.counters("moe_route_counter", 1)
    rt.launch(
        "moe",
        "moe_route_small",
        (-(-experts // ROUTE_ROWS),),
        256,
        x.address,
        norm_weight.address,
        np.float32(eps),
        router.address,
        router_bias.address if router_bias is not None else 0,
        routing.selection_bias.address if routing.selection_bias is not None else 0,
        normed.address,
        logits,
        counter,
        expert_ids.address,
        expert_weights.address,
        np.int32(num_tokens),
        np.int32(hidden),
        np.int32(experts),
        np.int32(routing.top_k),
        np.int32(routing.sigmoid),
        np.int32(routing.renormalize),
        np.float32(routing.scaling),
        *_table_tail(rt, held, num_tokens, routing.top_k),
        np.int32(routes_in_experts(rt, held, num_tokens, routing.top_k)),
    )


def top_k(
    rt: CudaRuntime,
    logits: CudaTensor,
    routing: RoutingArgs,
    held: HeldExperts,
    expert_ids: CudaTensor,
    expert_weights: CudaTensor,
) -> None:
    """ids and weights from logits [N, E] f32 (bias included): a warp per token; up to
    GEMV_MAX_TOKENS tokens the last block writes the slot table."""
    num_tokens = logits.shape[0]
    rt.launch(
        "moe",
        "moe_topk",
        (-(-num_tokens // 8),),
        256,
        logits.address,
        routing.selection_bias.address if routing.selection_bias is not None else 0,
        expert_ids.address,
        expert_weights.address,
        np.int32(num_tokens),
        *_routing_tail(routing),
        rt.counters("moe_topk_counter", 1),
        *_table_tail(rt, held, num_tokens, routing.top_k),
    )


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """The float32 scales of E4M3 experts (layout in expert_fp8.py): per 128 x 128 block
    (`block`) or per output channel; the shared expert's where it is E4M3 too."""

    block: bool
    gate_up: CudaTensor  # [E, 2I] or [E, 2I / 128, ceil(H / 128)]
    down: CudaTensor  # [E, H] or [E, ceil(H / 128), ceil(I / 128)]
    shared_gate_up: CudaTensor | None
    shared_down: CudaTensor | None

    @property
    def infix(self) -> str:
        """The kernel-name part of this layout (moe_gate_up_fp8_blk_silu, moe_down_fp8, ...)."""
        return "_fp8_blk" if self.block else "_fp8"


@dataclass(frozen=True, slots=True)
class ExpertWeights:
    """The device weights the expert kernels read (shapes as in moe.cu's file comment): bf16, or
    E4M3 bytes (routed and shared experts alike) with their `scales`."""

    gate_up: CudaTensor  # [E, 2I, H]
    gate_up_bias: CudaTensor | None  # [E, 2I]
    down: CudaTensor  # [E, H, I]
    down_bias: CudaTensor | None  # [E, H]
    shared_gate_up: CudaTensor | None  # [2Is, H]
    shared_down: CudaTensor | None  # [H, Is]
    shared_gate: CudaTensor | None  # [H]
    activation: GatedKind
    first_expert: int = 0  # gate_up[0] is routed expert first_expert (an expert-parallel rank's)
    scales: ExpertScales | None = None  # E4M3 experts' scales; None: bf16 experts

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def hidden(self) -> int:
        return self.gate_up.shape[2]

    @property
    def inner(self) -> int:
        return self.down.shape[2]

    @property
    def shared_inner(self) -> int:
        return self.shared_down.shape[1] if self.shared_down is not None else 0


def _address(tensor: CudaTensor | None) -> int:
    return tensor.address if tensor is not None else 0


def _infix(weights: ExpertWeights) -> str:
    return "" if weights.scales is None else weights.scales.infix


def _gate_up_args(weights: ExpertWeights) -> tuple:
    """gate_up [, its scales], its bias, the shared gate_up [, its scales]: the kernels' order."""
    scales = weights.scales
    if scales is None:
        return weights.gate_up.address, _address(weights.gate_up_bias), _address(weights.shared_gate_up)
    return (weights.gate_up.address, scales.gate_up.address, _address(weights.gate_up_bias),
            _address(weights.shared_gate_up), _address(scales.shared_gate_up))


def _down_args(weights: ExpertWeights) -> tuple:
    """down [, its scales], its bias, the shared down [, its scales]: the kernels' order."""
    scales = weights.scales
    if scales is None:
        return weights.down.address, _address(weights.down_bias), _address(weights.shared_down)
    return (weights.down.address, scales.down.address, _address(weights.down_bias), _address(weights.shared_down),
            _address(scales.shared_down))


def experts(
    rt: CudaRuntime,
    weights: ExpertWeights,
    routing: RoutingArgs,
    normed: CudaTensor,
    expert_ids: CudaTensor,
    expert_weights: CudaTensor,
    residual: CudaTensor,
    accumulate: bool = True,
) -> None:
    """residual += the held experts' weighted outputs + the (gated) shared expert's; with
    `accumulate` False, residual = that sum (its old rows unread). The grouped
    GEMV up to GEMV_MAX_TOKENS tokens (its down kernel's last blocks add into the residual; past
    ROUTE_SMALL_MAX_TOKENS the looped down kernel, whose blocks each take a share of the slots),
    else the alignment, the grouped GEMM and the combine. `routing` is what `route_small` ran
    with: where `routes_in_experts`, these kernels route the token from its logits and write
    expert_ids and expert_weights."""
    num_tokens, top_k_width = expert_ids.shape
    if num_tokens == 0:
        return
    hidden, inner, shared_inner = weights.hidden, weights.inner, weights.shared_inner
    experts_count = weights.num_experts
    has_shared = weights.shared_down is not None
    num_pairs = num_tokens * top_k_width
    rows = num_pairs + (num_tokens if has_shared else 0)
    stride = max(inner, shared_inner)
    hidden_rows = rt.workspace("moe_hidden", rows * stride * 2)
    outputs = rt.workspace("moe_outputs", rows * hidden * 4)
    act, infix = weights.activation, _infix(weights)
    dims = (np.int32(hidden), np.int32(inner), np.int32(shared_inner), np.int32(stride))
    if num_tokens <= GEMV_MAX_TOKENS:  # the routing wrote the slot table (global ids; the held ones local)
        held = HeldExperts(weights.first_expert, experts_count)
        if ring_applies(rt, weights, held, num_tokens, top_k_width, accumulate):
            rt.launch(
                "moe", "moe_ring_silu", (rt.num_sms,), _RING_THREADS,
                normed.address, _logits(rt, 1, routing.num_experts), _address(routing.selection_bias),
                np.int32(routing.num_experts), np.int32(top_k_width), np.int32(routing.sigmoid),
                np.int32(routing.renormalize), np.float32(routing.scaling), weights.gate_up.address,
                weights.down.address, np.int32(inner), hidden_rows, np.int32(stride), residual.address,
                expert_ids.address, expert_weights.address, rt.counters("moe_ring_barrier", 2),
                shared_bytes=_RING_SHARED_BYTES,
            )
            return
        table = slot_table(rt, held, num_tokens, top_k_width)
        routed = routed_slots(held, num_tokens, top_k_width)
        slots = routed + (1 if has_shared else 0)
        head = (np.int32(num_tokens), np.int32(top_k_width), np.int32(experts_count))
        gate_values = rt.workspace("moe_shared_gate", num_tokens * 4) if weights.shared_gate is not None else 0
        local = _local_route_args(rt, routing, routes_in_experts(rt, held, num_tokens, top_k_width))
        rt.launch(
            "moe", f"moe_gate_up{infix}_{act.name}", (-(-stride // 8), slots), _WARPS * 32,
            normed.address, table, *_gate_up_args(weights), hidden_rows, *head, *dims, np.int32(routed),
            np.float32(act.alpha), np.float32(act.limit), _address(weights.shared_gate), gate_values,
            *local, np.int32(weights.first_expert), expert_ids.address, expert_weights.address,
        )
        row_tiles = -(-hidden // _DOWN_ROWS)
        if num_tokens > ROUTE_SMALL_MAX_TOKENS:
            # most experts touched: a block loops over slots, each token's sum in shared memory
            groups = max(1, min(slots, _DOWN_LOOPED_BLOCKS_PER_SM * rt.num_sms // row_tiles))
            partials = rt.workspace("moe_down_partials", groups * num_tokens * hidden * 4)
            rt.launch(
                "moe", f"moe_down_looped{infix}", (row_tiles, groups), _WARPS * 32,
                hidden_rows, table, *_down_args(weights), partials, *head, *dims, np.int32(routed), np.int32(slots),
                expert_weights.address, gate_values, residual.address,
                rt.counters("moe_down_looped_counters", row_tiles), np.int32(accumulate),
            )
            return
        # the last block of each row tile adds the tile's rows into the residual (the combine)
        rt.launch(
            "moe", f"moe_down{infix}", (row_tiles, slots), _WARPS * 32,
            hidden_rows, table, expert_ids.address, np.int32(weights.first_expert), *_down_args(weights),
            outputs, *head, *dims, np.int32(routed),
            expert_weights.address,
            gate_values, np.int32(has_shared), residual.address, rt.counters("moe_down_counters", row_tiles),
            np.int32(accumulate), *local,
        )
        return
    if weights.first_expert:
        local = rt.scratch_tensor("moe_local_ids", expert_ids.shape, DType.I32)
        rt.launch("moe", "moe_shift_ids", (-(-num_pairs // 256),), 256, expert_ids.address, local.address,
                  np.int32(num_pairs), np.int32(weights.first_expert))
        expert_ids = local
    groups = experts_count + (1 if has_shared else 0)
    offsets = rt.workspace("moe_offsets", (groups + 1) * 4)
    tile_starts = rt.workspace("moe_tile_starts", (groups + 1) * 4)
    sorted_pairs = rt.workspace("moe_sorted_pairs", rows * 4)
    rt.launch(
        "moe", "moe_align", (1,), 1024,
        expert_ids.address, np.int32(num_tokens), np.int32(top_k_width), np.int32(experts_count),
        np.int32(has_shared), offsets, tile_starts, sorted_pairs,
    )
    # sum over groups of ceil(rows_g / 128) <= rows / 128 + the groups that have rows
    max_tiles = -(-rows // _GEMM_ROWS) + min(groups, rows)
    layout = (offsets, tile_starts, sorted_pairs)
    # The same tiles on wgmma where the module has them (kernels/sm90/moe.cu), else mma.sync;
    # E4M3 experts on mma.sync, their tiles widened to bf16 in shared memory.
    wgmma = (weights.scales is None and rt.features.moe_wgmma and _WGMMA_SHARED_BYTES <= rt.max_shared_optin
             and rt.kernels.provides("moe", "moe_wgmma_down"))
    kernel, threads, shared_bytes = ("wgmma", _WGMMA_THREADS, _WGMMA_SHARED_BYTES) if wgmma else (
        "gemm", _GEMM_THREADS, _GEMM_SHARED_BYTES if weights.scales is None else _GEMM_FP8_SHARED_BYTES)
    rt.launch(
        "moe", f"moe_{kernel}_gate_up{infix}_{act.name}", (-(-stride // (_GEMM_ROWS // 2)), max_tiles), threads,
        normed.address, *layout, *_gate_up_args(weights), hidden_rows, np.int32(num_tokens), np.int32(top_k_width),
        np.int32(experts_count), np.int32(groups), *dims, np.float32(act.alpha), np.float32(act.limit),
        shared_bytes=shared_bytes,
    )
    rt.launch(
        "moe", f"moe_{kernel}_down{infix}", (-(-hidden // _GEMM_ROWS), max_tiles), threads,
        hidden_rows, *layout, *_down_args(weights), outputs, np.int32(experts_count), np.int32(groups), *dims,
        shared_bytes=shared_bytes,
    )
    rt.launch(
        "moe", "moe_combine", (num_tokens,), 256,
        outputs, expert_ids.address, expert_weights.address, normed.address, _address(weights.shared_gate),
        np.int32(has_shared), residual.address, np.int32(num_tokens), np.int32(top_k_width), np.int32(experts_count),
        np.int32(hidden), np.int32(accumulate),
    )


def check_routing_outputs(
    expert_ids: CudaTensor, expert_weights: CudaTensor, num_tokens: int, top_k_width: int
) -> None:
    for name, tensor, dtype in (("expert_ids", expert_ids, DType.I32), ("expert_weights", expert_weights, DType.F32)):
        checks.dtype(tensor, name, (dtype,))
        checks.shape(tensor, name, (num_tokens, top_k_width))
