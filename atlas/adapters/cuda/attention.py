"""The attention kind on CUDA: the paged KV cache, the q/k/v projection with RoPE and the cache
write, and paged attention (prefill tiles and split-K decode).

`project` picks, for the step's shape, the path with the fewest kernels: one token on rows up to
2048 wide is one GEMV that normalises x, rotates q and k and writes the cache in its epilogue;
past the GEMV sizes a folded norm leaves its RMS to the RoPE kernel after cuBLASLt's product
(`rms_after_product`); else the norm (in the GEMV, or a kernel), the product, then the RoPE
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from atlas.adapters.cuda import ops_attention
from atlas.adapters.cuda.dense import NORMED, PRODUCT, CudaDense
from atlas.adapters.cuda.kv_cache import CudaKvCache
from atlas.adapters.cuda.ops_dense import LinearOp
from atlas.adapters.cuda.ops_fp8 import Fp8Matrix
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType, UnsupportedError
from atlas.ports.kernels.attention import AttentionLayer, AttentionMetadata, HostAttention, KvCacheSpec


@dataclass(frozen=True, slots=True)
class CudaAttentionLayer:
    spec: AttentionLayer
    qkv: CudaTensor | Fp8Matrix  # [(Hq + 2 Hkv) D, H] bf16 (times the input norm's weight where `norm` is
    # None), or FP8 (never folded)
    bias: CudaTensor | None
    norm: CudaTensor | None  # [H] bf16; None: folded into qkv
    eps: float  # of the input norm, and of the q/k norms
    q_norm: CudaTensor | None  # [D] bf16
    k_norm: CudaTensor | None
    rope_table: CudaTensor | None
    extras: ops_attention.AttentionExtras | None = None  # sinks, soft-cap, gated output


class CudaAttention:
    """`AttentionKernels` on one GPU."""

    def __init__(
        self, rt: CudaRuntime, linear: LinearOp, dense: CudaDense, kv_dtypes: tuple[DType, ...], upload=None
    ) -> None:
        self._rt = rt
        self._linear = linear
        self._dense = dense
        self._kv_dtypes = kv_dtypes
        self._upload = upload  # CudaGpuBackend.upload (the sinks' f32 logits)

    def allocate_cache(self, spec: KvCacheSpec) -> CudaKvCache:
        rt = self._rt
        rt.ensure_current()
        rt.forbid_in_capture("allocate_cache")
        if spec.dtype not in self._kv_dtypes:
            supported = ", ".join(dtype.value for dtype in self._kv_dtypes)
            raise ValueError(f"spec.dtype: {spec.dtype.value} KV caches are not supported on this GPU ({supported})")
        if spec.head_dim % 8:
            raise ValueError(f"spec.head_dim: {spec.head_dim} is not a multiple of 8")
        try:
            allocation = rt.pool.allocate(spec.total_bytes)
        except MemoryError as error:
            free, _ = rt.memory_info()
            fits = free // spec.bytes_per_block
            raise MemoryError(
                f"a KV cache of {spec.num_blocks} blocks needs {spec.total_bytes / 2**30:.2f} GiB; "
                f"{free / 2**30:.2f} GiB free holds {fits} blocks ({error})"
            ) from error
        return CudaKvCache(spec, allocation)

    def prepare(self, host: HostAttention, layer: AttentionLayer) -> CudaAttentionLayer:
        heads = layer.heads
        if heads.head_dim not in ops_attention.SUPPORTED_HEAD_DIMS:
            raise UnsupportedError(f"head_dim {heads.head_dim}: not supported by the CUDA backend's attention yet")
        if host.sinks is not None and np.shape(host.sinks) != (heads.num_q_heads,):
            raise ValueError(f"sinks: shape {list(np.shape(host.sinks))} is not [{heads.num_q_heads}]")
        eps = host.input_norm.eps
        if any(norm is not None and norm.eps != eps for norm in (host.q_norm, host.k_norm)):
            raise UnsupportedError("q_norm/k_norm: an eps other than the input norm's is not supported on CUDA")
        if (host.q_norm is None) != (host.k_norm is None):
            raise ValueError("q_norm and k_norm: give both or neither")
        width = layer.q_width + 2 * heads.kv_size
        if host.qkv.out_features != width:
            raise ValueError(f"qkv: {host.qkv.out_features} rows, the heads need {width}")
        qkv, bias = self._dense.weights(host.qkv, "qkv")
        upload = self._dense.upload_norm
        norms = (None if norm is None else upload(norm) for norm in (host.q_norm, host.k_norm))
        prepared = self.layer(layer, qkv, bias, upload(host.input_norm), eps, *norms)
        if host.sinks is None and layer.logit_softcap is None and not layer.gated_output:
            return prepared
        sinks = None if host.sinks is None else self._upload(np.asarray(host.sinks, np.float32), DType.F32)
        extras = ops_attention.AttentionExtras(sinks, layer.logit_softcap, layer.gated_output)
        return replace(prepared, extras=extras)

    def layer(
        self,
        spec: AttentionLayer,
        qkv: CudaTensor | Fp8Matrix,
        bias: CudaTensor | None,
        norm: CudaTensor,
        eps: float,
        q_norm: CudaTensor | None = None,
        k_norm: CudaTensor | None = None,
        fold: bool = True,
    ) -> CudaAttentionLayer:
        """A layer over bf16 weights already on the device (`prepare`'s second half), the input
        norm folded into qkv where `fold_rmsnorm` takes it unless `fold` is False or the qkv GEMV
        takes the RoPE epilogue (`LinearOp.rope_epilogue`: it needs the norm unfolded)."""
        epilogue = (q_norm is None and k_norm is None and not spec.gated_output and spec.rope_table is not None
                    and isinstance(qkv, CudaTensor) and self._linear.rope_epilogue(qkv.shape[1]))
        folded = fold and not epilogue and isinstance(qkv, CudaTensor) and self._linear.fold_rmsnorm(norm, qkv)
        return CudaAttentionLayer(spec, qkv, bias, None if folded else norm, eps, q_norm, k_norm, spec.rope_table)

    def project(
        self, x: CudaTensor, layer: CudaAttentionLayer, meta: AttentionMetadata, cache: CudaKvCache, q_out: CudaTensor
    ) -> None:
        rt, linear, spec = self._rt, self._linear, layer.spec
        heads, index, gated = spec.heads, spec.cache_layer, spec.gated_output
        if isinstance(layer.qkv, Fp8Matrix):  # the norm is taken by the norm or quantizing kernel
            qkv = rt.scratch_tensor(PRODUCT, (x.shape[0], layer.qkv.shape[0]), x.dtype)
            self._dense.fp8.project(x, layer.qkv, qkv, layer.bias, layer.norm, layer.eps)
            ops_attention.rope_and_cache(
                rt, qkv, meta, layer.rope_table, cache, index, heads, q_out, layer.q_norm, layer.k_norm, layer.eps,
                gated=gated,
            )
            return
        if layer.q_norm is None and layer.k_norm is None and not gated and layer.rope_table is not None:
            targets = ops_attention.rope_targets(meta, layer.rope_table, cache, index, heads, q_out)
            if targets is not None and linear.rmsnorm_linear_rope(
                x, layer.norm, layer.eps, layer.qkv, layer.bias, q_out, targets
            ):
                return
        qkv = rt.scratch_tensor(PRODUCT, (x.shape[0], layer.qkv.shape[0]), x.dtype)
        if layer.bias is None and linear.rms_after_product(x, layer.norm):
            linear(x, layer.qkv, qkv, None)  # the RoPE kernel scales by the norm's RMS
            ops_attention.rope_and_cache(
                rt, qkv, meta, layer.rope_table, cache, index, heads, q_out, layer.q_norm, layer.k_norm, layer.eps,
                rms_source=x, gated=gated,
            )
            return
        normed = rt.scratch_tensor(NORMED, x.shape, x.dtype)
        linear.rmsnorm_linear(x, layer.norm, layer.eps, layer.qkv, qkv, normed, layer.bias)
        ops_attention.rope_and_cache(
            rt, qkv, meta, layer.rope_table, cache, index, heads, q_out, layer.q_norm, layer.k_norm, layer.eps,
            gated=gated,
        )

    def attend(
        self, q: CudaTensor, layer: CudaAttentionLayer, meta: AttentionMetadata, cache: CudaKvCache, out: CudaTensor
    ) -> None:
        spec = layer.spec
        ops_attention.attention(
            self._rt, q, cache, spec.cache_layer, meta, spec.heads, spec.scale, out, spec.sliding_window, layer.extras
        )
