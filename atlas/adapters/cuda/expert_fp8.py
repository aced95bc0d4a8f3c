"""FP8 (E4M3) expert weights as the CUDA MoE kernels read them (kernels/common/moe.cuh's
`Fp8Experts`), checked and laid out on the host; numpy only, so it runs without a GPU.

A stack of E experts [E, rows, K] of E4M3 bytes, row-major as the checkpoint stores each expert
([out, in]), with float32 multipliers (never inverses):

    per channel   scales [E, rows]                                W[e, r, k] = byte * scales[e, r]
    per block     scales [E, ceil(rows / 128), ceil(K / 128)]     W[e, r, k] = byte * scales[e, r / 128, k / 128]

A shared expert is a stack of one, [rows, K] with scales [rows] or [ceil(rows / 128),
ceil(K / 128)]. The kernels read expert e's scales at e * (its scale count), so the arrays go up
as they are, contiguous: no padding (cuBLASLt's stride rule is the dense layers', not this one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlas.ports.gpu import NUMPY_DTYPES, DType, UnsupportedError
from atlas.ports.kernels.host_weights import HostLinear
from atlas.ports.kernels.moe import HostMoe

BLOCK = 128  # the only block shape the kernels take (rows and columns)
ROW_MULTIPLE = 16  # K % 16: a lane's 16-byte load of E4M3 holds 16 weights


@dataclass(frozen=True, slots=True, eq=False)  # arrays: compare the fields, not the objects
class Fp8ExpertStack:
    """E4M3 bytes [..., rows, K] and their float32 scales in the kernels' layout (module docstring)."""

    data: np.ndarray
    scales: np.ndarray
    block: bool


def is_fp8(linear: HostLinear) -> bool:
    return linear.scales is not None


def fp8_expert_stack(linear: HostLinear, what: str) -> Fp8ExpertStack:
    """`linear` (E4M3 experts [E, rows, K], or one shared expert [rows, K], with their scales) as
    the kernels read it. Raises `UnsupportedError` for blocks other than 128 x 128 and for K not a
    multiple of 16 (both name what to change), `ValueError` for bytes that are not E4M3 or
    scales that fit neither layout."""
    weight = np.asarray(linear.weight)
    if weight.dtype != NUMPY_DTYPES[DType.FP8_E4M3] or weight.ndim not in (2, 3) or linear.scales is None:
        raise ValueError(f"{what}: FP8 experts must be float8_e4m3fn [E, out, in] with scales, got "
                         f"{weight.dtype} {list(weight.shape)}")
    *lead, rows, inner = weight.shape
    if inner % ROW_MULTIPLE:
        raise UnsupportedError(f"{what}: FP8 experts need an input width that is a multiple of {ROW_MULTIPLE} on "
                               f"CUDA, got {inner}; load the float checkpoint instead")
    scales = np.asarray(linear.scales, np.float32)
    if linear.block_shape is None:
        expected = (*lead, rows)
    elif tuple(linear.block_shape) == (BLOCK, BLOCK):
        expected = (*lead, -(-rows // BLOCK), -(-inner // BLOCK))
    else:
        raise UnsupportedError(
            f"{what}: FP8 expert blocks of {list(linear.block_shape)}; the CUDA backend runs 128 x 128 blocks or "
            f"per-channel scales (load the float checkpoint with --quantization fp8 for per-channel FP8)")
    if scales.shape != expected:
        layout = "per-channel" if linear.block_shape is None else "block"
        raise ValueError(f"{what}: {layout} scales must be {list(expected)}, got {list(scales.shape)}")
    return Fp8ExpertStack(weight, np.ascontiguousarray(scales), linear.block_shape is not None)


@dataclass(frozen=True, slots=True, eq=False)
class Fp8MoeWeights:
    """An MoE layer's E4M3 experts, and its shared expert's where there is one, in one layout."""

    gate_up: Fp8ExpertStack  # [E, 2I, H]
    down: Fp8ExpertStack  # [E, H, I]
    shared_gate_up: Fp8ExpertStack | None  # [2Is, H]
    shared_down: Fp8ExpertStack | None  # [H, Is]

    @property
    def block(self) -> bool:
        return self.gate_up.block


def fp8_moe_weights(host: HostMoe) -> Fp8MoeWeights:
    """The E4M3 experts of `host` (whose gate_up and down are FP8) as the kernels read them.
    Raises `UnsupportedError` (naming the fix) for a float shared expert beside them and for
    layouts mixed within the layer (one kernel reads every expert, the shared one included), as
    `fp8_expert_stack` does for what a stack cannot be."""
    stacks = [fp8_expert_stack(host.gate_up, "gate_up"), fp8_expert_stack(host.down, "down")]
    shared = host.shared
    if shared is not None:
        if not (is_fp8(shared.gate_up) and is_fp8(shared.down)):
            raise UnsupportedError("shared: a float shared expert beside FP8 experts is not supported by the CUDA "
                                   "backend; load the float checkpoint with --quantization fp8 (it quantizes both)")
        stacks += [fp8_expert_stack(shared.gate_up, "shared.gate_up"), fp8_expert_stack(shared.down, "shared.down")]
    if len({stack.block for stack in stacks}) != 1:
        raise UnsupportedError("experts: FP8 experts mix block and per-channel scales, which the CUDA kernels cannot "
                               "read in one layer; requantize them alike")
    return Fp8MoeWeights(*stacks, *((None, None) if shared is None else ()))
