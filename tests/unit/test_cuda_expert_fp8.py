"""FP8 experts as the CUDA MoE kernels read them (atlas/adapters/cuda/expert_fp8.py), on the host:
the kernels' own indexing of bytes and scales (moe.cuh's Fp8Experts) must give the weights the
mock computes with (`HostLinear.values()`), and what they cannot read is refused by name."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from atlas.adapters.cuda.expert_fp8 import fp8_expert_stack, fp8_moe_weights
from atlas.domain.models.quantization_config import Fp8Layout
from atlas.domain.models.quantization_weights import (
    QuantizedWeight,
    host_linear,
    quantize_per_channel,
    stack_experts,
    stack_rows,
)
from atlas.ports.gpu import UnsupportedError
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm
from atlas.ports.kernels.moe import HostMoe, HostSharedExpert, Routing

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _bytes(rng, *shape) -> np.ndarray:
    return np.clip(rng.standard_normal(shape) * 100, -448, 448).astype(E4M3)


def _block_linear(rng, experts: int, rows: int, inner: int) -> HostLinear:
    scales = rng.uniform(0.5, 2.0, (experts, -(-rows // 128), -(-inner // 128))).astype(np.float32) / 1000
    return HostLinear(_bytes(rng, experts, rows, inner), scales=scales, block_shape=(128, 128))


def _kernel_values(data: np.ndarray, scales: np.ndarray, block: bool) -> np.ndarray:
    """What the kernels compute each weight as: byte * flat_scales[e * count + offset(r, k)], with
    count and offset as moe.cuh's pick_expert and fp8_scale_offset write them."""
    experts, rows, inner = data.shape
    flat = scales.reshape(-1)
    count = -(-rows // 128) * -(-inner // 128) if block else rows
    e, r, k = np.meshgrid(np.arange(experts), np.arange(rows), np.arange(inner), indexing="ij")
    offset = (r >> 7) * -(-inner // 128) + (k >> 7) if block else r
    return data.astype(np.float32) * flat[e * count + offset]


@pytest.mark.parametrize("rows, inner", [(256, 320), (200, 128), (384, 2048)])
def test_block_scaled_experts_go_up_with_the_tile_scales_the_kernels_index(rng, rows, inner):
    """Partial last tiles of rows (200) and of columns (320) included: each expert's scales start
    at e * its tile count, a row's at (r / 128) * ceil(K / 128)."""
    linear = _block_linear(rng, 3, rows, inner)
    stack = fp8_expert_stack(linear, "gate_up")
    assert stack.block and stack.scales.dtype == np.float32 and stack.scales.flags.c_contiguous
    np.testing.assert_array_equal(_kernel_values(stack.data, stack.scales, True), linear.values())


def test_per_channel_experts_quantized_at_load_keep_a_scale_per_row(rng):
    """`--quantization fp8`'s layout: one scale per output row of each expert."""
    weights = rng.standard_normal((4, 96, 64)).astype(np.float32)
    linear = stack_experts([host_linear(quantize_per_channel(weights[e])) for e in range(4)])
    stack = fp8_expert_stack(linear, "down")
    assert not stack.block and stack.scales.shape == (4, 96)
    np.testing.assert_array_equal(_kernel_values(stack.data, stack.scales, False), linear.values())


def test_per_tensor_experts_arrive_as_per_channel_scales(rng):
    """compressed-tensors' per-tensor scale becomes one per row (host_linear), read per channel."""
    experts = [QuantizedWeight(_bytes(rng, 64, 32), np.float32(0.01 * (e + 1)), Fp8Layout.PER_TENSOR)
               for e in range(2)]
    linear = stack_experts([host_linear(weight) for weight in experts])
    stack = fp8_expert_stack(linear, "gate_up")
    assert not stack.block and stack.scales.shape == (2, 64)
    np.testing.assert_array_equal(_kernel_values(stack.data, stack.scales, False), linear.values())


def test_gate_and_up_fused_by_rows_keep_their_own_tiles(rng):
    """An expert's gate | up stacked as the Qwen3-MoE loader does (whole 128-row tiles)."""
    gate = QuantizedWeight(_bytes(rng, 128, 256), rng.uniform(0.5, 2, (1, 2)).astype(np.float32), Fp8Layout.BLOCK,
                           (128, 128))
    up = QuantizedWeight(_bytes(rng, 128, 256), rng.uniform(3, 4, (1, 2)).astype(np.float32), Fp8Layout.BLOCK,
                         (128, 128))
    linear = stack_experts([host_linear(stack_rows([gate, up]))])
    stack = fp8_expert_stack(linear, "gate_up")
    np.testing.assert_array_equal(_kernel_values(stack.data, stack.scales, True), linear.values())
    assert stack.scales[0, 1, 0] >= 3  # the up rows' tile


def _moe(gate_up: HostLinear, down: HostLinear, shared: HostSharedExpert | None = None) -> HostMoe:
    experts, rows, hidden = gate_up.weight.shape
    router = HostLinear(np.zeros((experts, hidden), np.float32))
    return HostMoe(RmsNorm(np.ones(hidden, np.float32), 1e-6), router, gate_up, down, Activation.SILU,
                   Routing(experts, 2), shared=shared)


def test_a_layer_with_an_fp8_shared_expert_reads_it_in_the_experts_layout(rng):
    shared = HostSharedExpert(_block_linear(rng, 1, 256, 256), _block_linear(rng, 1, 256, 128))
    shared = HostSharedExpert(*(HostLinear(linear.weight[0], scales=linear.scales[0], block_shape=(128, 128))
                                for linear in (shared.gate_up, shared.down)))
    weights = fp8_moe_weights(_moe(_block_linear(rng, 4, 256, 256), _block_linear(rng, 4, 256, 128), shared))
    assert weights.block and weights.shared_down is not None and weights.shared_down.scales.shape == (2, 1)
    alone = fp8_moe_weights(_moe(_block_linear(rng, 4, 256, 256), _block_linear(rng, 4, 256, 128)))
    assert alone.shared_gate_up is None and alone.shared_down is None


def test_what_the_kernels_cannot_read_is_refused_naming_the_fix(rng):
    odd_blocks = HostLinear(_bytes(rng, 2, 128, 128), scales=np.ones((2, 2, 2), np.float32), block_shape=(64, 64))
    with pytest.raises(UnsupportedError, match=r"128 x 128.*--quantization fp8"):
        fp8_expert_stack(odd_blocks, "gate_up")
    narrow = HostLinear(_bytes(rng, 2, 64, 40), scales=np.ones((2, 64), np.float32))
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        fp8_expert_stack(narrow, "down")
    with pytest.raises(ValueError, match=r"block scales must be \[2, 1, 1\]"):
        fp8_expert_stack(HostLinear(_bytes(rng, 2, 64, 64), scales=np.ones((2, 2, 1), np.float32),
                                    block_shape=(128, 128)), "down")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_expert_stack(HostLinear(np.zeros((2, 64, 64), np.float32), scales=np.ones((2, 64), np.float32)), "down")
    float_shared = HostSharedExpert(HostLinear(np.zeros((256, 256), np.float32)),
                                    HostLinear(np.zeros((256, 128), np.float32)))
    with pytest.raises(UnsupportedError, match="float shared expert beside FP8 experts"):
        fp8_moe_weights(_moe(_block_linear(rng, 4, 256, 256), _block_linear(rng, 4, 256, 128), float_shared))
    per_channel_down = HostLinear(_bytes(rng, 4, 256, 128), scales=np.ones((4, 256), np.float32))
    with pytest.raises(UnsupportedError, match="mix block and per-channel"):
        fp8_moe_weights(_moe(_block_linear(rng, 4, 256, 256), per_channel_down))
