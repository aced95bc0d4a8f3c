"""The dense kind's family variants on CUDA (kernels/common/dense_variants.cu): a gated product
with a bias or GPT-OSS's clamped SwiGLU, a norm after the product (Gemma's sandwich norms), the
embedding scale and soft-capped logits.

They compose the existing product (`product_op`: `LinearOp` on bf16 weights, `Fp8LinearOp` on
FP8; unfused, the projection's norm is never folded for them) with small kernels, so the
Llama-shaped path that `dense.py` runs is untouched: `needs_variant` says which projections come
here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from atlas.adapters.cuda import ops_dense
from atlas.adapters.cuda.ops_moe import gated_kind
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType
from atlas.ports.kernels.host_weights import Activation

NORMED = "variant_normed"
PRODUCT = "variant_product"
GATED = "variant_gated"


Product = Callable[[CudaTensor, object, CudaTensor, "CudaTensor | None"], None]  # (x, weight, out, bias)


def needs_variant(activation, bias: object | None, output_norm: object | None) -> bool:
    """Whether a projection goes through `project` here: a clamped SwiGLU, a bias on a gated
    product, or a norm after the product."""
    gated = activation is not None
    return output_norm is not None or (gated and (bias is not None or not isinstance(activation, Activation)))


def _blocks(rt: CudaRuntime, count: int) -> int:
    return int(max(1, min(-(-count // 256), rt.num_sms * 8)))


def project(rt: CudaRuntime, product_op: Product, x: CudaTensor, projection, out: CudaTensor) -> None:
    """out = output_norm(act(input_norm(x) @ W.T + b)) for a `CudaProjection` (its norm unfolded)."""
    num_tokens = x.shape[0]
    source = x
    if projection.normalized:
        source = rt.scratch_tensor(NORMED, x.shape, x.dtype)
        ops_dense.rmsnorm(rt, x, None, projection.norm, projection.eps, source)
    rows = projection.weight.shape[0]
    plain = projection.activation is None and projection.output_norm is None
    product = out if plain else rt.scratch_tensor(PRODUCT, (num_tokens, rows), out.dtype)
    product_op(source, projection.weight, product, projection.bias)
    if projection.activation is not None:
        gated = out if projection.output_norm is None else rt.scratch_tensor(GATED, (num_tokens, rows // 2), out.dtype)
        kind = gated_kind(projection.activation)
        count = num_tokens * (rows // 2)
        if count:
            rt.launch("dense_variants", f"gated_act_{kind.name}", (_blocks(rt, count),), 256, product.address,
                      gated.address, np.int32(num_tokens), np.int32(rows // 2), np.float32(kind.alpha),
                      np.float32(kind.limit))
        product = gated
    if projection.output_norm is not None:
        ops_dense.rmsnorm(rt, product, None, projection.output_norm, projection.output_eps, out)


def project_add(rt: CudaRuntime, product_op: Product, x: CudaTensor, projection, residual: CudaTensor) -> None:
    """residual += the projection (with its output norm, in one kernel after the product)."""
    delta = rt.scratch_tensor(PRODUCT, residual.shape, residual.dtype)
    if projection.output_norm is None:
        project(rt, product_op, x, projection, delta)
        ops_dense.add_into(rt, delta, residual)
        return
    source = x
    if projection.normalized:
        source = rt.scratch_tensor(NORMED, x.shape, x.dtype)
        ops_dense.rmsnorm(rt, x, None, projection.norm, projection.eps, source)
    product_op(source, projection.weight, delta, projection.bias)
    num_tokens, hidden = residual.shape
    if hidden % 8:
        raise ValueError(f"residual: width {hidden} is not a multiple of 8 (an output norm's kernel)")
    if num_tokens:
        rt.launch("dense_variants", "add_rmsnorm_of_bf16", (num_tokens,), 256, delta.address,
                  projection.output_norm.address, np.float32(projection.output_eps), residual.address,
                  np.int32(hidden))


def scale_rows(rt: CudaRuntime, x: CudaTensor, scale: float) -> None:
    """x *= scale in place (bf16)."""
    count = x.num_elements
    if count and scale != 1.0:
        rt.launch("dense_variants", "scale_bf16", (_blocks(rt, count),), 256, x.address, np.int64(count),
                  np.float32(scale))


def softcap(rt: CudaRuntime, logits: CudaTensor, cap: float | None) -> None:
    """logits = cap tanh(logits / cap) in place (f32)."""
    count = logits.num_elements
    if count and cap is not None:
        if logits.dtype is not DType.F32:
            raise ValueError(f"out: soft-capped logits must be f32, not {logits.dtype.value}")
        rt.launch("dense_variants", "softcap_f32", (_blocks(rt, count),), 256, logits.address, np.int64(count),
                  np.float32(cap))
