"""The dense kind on CUDA: projections through `LinearOp` (decode GEMVs that normalise x, apply
the gated activation and add into the residual themselves; the skinny GEMM; cuBLASLt).

`prepare` uploads bf16 weights and, where that removes the norm kernel from a decode step (rows
wider than the GEMV normalises itself), folds the input norm's weight into the matrix
(`LinearOp.fold_rmsnorm`); a folded projection carries no norm weight and its products scale by
each row's inverse RMS. Intermediates the fused kernels skip (the norm's output, a product before
its activation or add) live in the runtime's workspaces.

FP8 weights (`HostLinear.scales`) stay E4M3 with their scales (`ops_fp8.Fp8Matrix`) and run
through `Fp8LinearOp`; their norm weight is never folded (it would rescale E4M3 columns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from atlas.adapters.cuda import checks, ops_dense
from atlas.adapters.cuda.ops_dense import LinearOp
from atlas.adapters.cuda.ops_fp8 import Fp8LinearOp, Fp8Matrix, upload_fp8
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType, UnsupportedError
from atlas.ports.kernels.dense import HostProjection, HostVocab
from atlas.ports.kernels.host_weights import Activation, HostLinear, RmsNorm

NORMED = "normed"  # workspace: rmsnorm(x) where no kernel fuses it
PRODUCT = "product"  # workspace: a product before its activation or its add


@dataclass(frozen=True, slots=True)
class CudaProjection:
    weight: CudaTensor | Fp8Matrix  # [out, in] bf16 (times the norm weight where folded), or FP8
    bias: CudaTensor | None  # [out] bf16
    norm: CudaTensor | None  # [in] bf16: the input norm's weight, unless folded or absent
    eps: float
    normalized: bool  # an input norm applies (its weight in `norm` or folded into `weight`)
    activation: Activation | None


@dataclass(frozen=True, slots=True)
class CudaVocab:
    embedding: CudaTensor  # [V, H] bf16
    final_norm: CudaTensor | None  # [H] bf16; None: folded into lm_head
    eps: float
    lm_head: CudaTensor  # [V, H] bf16, the embedding itself when tied


class CudaDense:
    """`DenseKernels` on one GPU."""

    def __init__(self, rt: CudaRuntime, linear: LinearOp, fp8: Fp8LinearOp, upload) -> None:
        self._rt = rt
        self._linear = linear
        self.fp8 = fp8  # the FP8 projections' op (the attention kind's qkv uses it too)
        self._upload = upload  # CudaGpuBackend.upload

    # -- preparing ------------------------------------------------------------------------
    def matrix(self, host: HostLinear, what: str) -> tuple[CudaTensor, CudaTensor | None]:
        """(weight, bias) in bf16; `UnsupportedError` for a quantized weight (see `weights`)."""
        if host.scales is not None:
            raise UnsupportedError(f"{what}: an FP8 weight is not supported by the CUDA backend here")
        return self.weights(host, what)  # type: ignore[return-value]

    def weights(self, host: HostLinear, what: str) -> tuple[CudaTensor | Fp8Matrix, CudaTensor | None]:
        """(weight, bias): bf16, or FP8 bytes with their scales (`upload_fp8`'s errors)."""
        if np.ndim(host.weight) != 2:
            raise ValueError(f"{what}: weight shape {list(np.shape(host.weight))} is not [out, in]")
        if host.scales is not None:
            weight: CudaTensor | Fp8Matrix = upload_fp8(self._rt, self._upload, host, what)
        else:
            weight = self._upload(host.weight, DType.BF16)
        bias = None if host.bias is None else self._upload(host.bias, DType.BF16)
        return weight, bias

    def upload_norm(self, norm: RmsNorm) -> CudaTensor:
        """A norm's weight in bf16 (the norm kernels' and GEMV prologues' `_bf16` forms)."""
        return self._upload(norm.weight, DType.BF16)

    def folded_norm(self, norm: RmsNorm, weight: CudaTensor) -> CudaTensor | None:
        """The norm weight in bf16, or None where it was folded into `weight`."""
        norm_weight = self.upload_norm(norm)
        return None if self._linear.fold_rmsnorm(norm_weight, weight) else norm_weight

    def prepare(self, host: HostProjection) -> CudaProjection:
        if host.output_norm is not None:
            raise UnsupportedError("output_norm: a norm after the product is not supported by the CUDA backend yet")
        if host.activation is not None and not isinstance(host.activation, Activation):
            raise UnsupportedError(f"activation: {host.activation} is not supported by the CUDA backend yet")
        weight, bias = self.weights(host.linear, "linear")
        if host.activation is not None and bias is not None:
            raise UnsupportedError("linear: a bias on a gated projection is not supported by the CUDA backend yet")
        norm = None if host.input_norm is None else self.upload_norm(host.input_norm)
        eps = 0.0 if host.input_norm is None else host.input_norm.eps
        return self.projection(weight, bias, norm, eps, host.activation)

    def projection(
        self,
        weight: CudaTensor | Fp8Matrix,
        bias: CudaTensor | None,
        norm: CudaTensor | None,
        eps: float,
        activation: Activation | None,
        fold: bool = True,
    ) -> CudaProjection:
        """A projection over weights already on the device (`prepare`'s second half;
        benchmarks fill their weights on the device), the norm weight folded into a bf16 `weight`
        where `fold_rmsnorm` takes it unless `fold` is False."""
        folded = (
            norm is not None and fold and isinstance(weight, CudaTensor) and self._linear.fold_rmsnorm(norm, weight)
        )
        return CudaProjection(weight, bias, None if folded else norm, eps, norm is not None, activation)

    def prepare_vocab(self, host: HostVocab) -> CudaVocab:
        if host.embedding_scale != 1.0:
            raise UnsupportedError("embedding_scale: a scaled embedding is not supported by the CUDA backend yet")
        if host.logit_softcap is not None:
            raise UnsupportedError("logit_softcap: soft-capped logits are not supported by the CUDA backend yet")
        lm_head = None
        if host.lm_head is not None:
            lm_head, bias = self.matrix(host.lm_head, "lm_head")
            if bias is not None:
                raise UnsupportedError("lm_head: a bias is not supported by the CUDA backend yet")
        embedding = self._upload(host.embedding, DType.BF16)
        return self.vocab(embedding, self.upload_norm(host.final_norm), host.final_norm.eps, lm_head)

    def vocab(
        self, embedding: CudaTensor, final_norm: CudaTensor, eps: float, lm_head: CudaTensor | None, fold: bool = True
    ) -> CudaVocab:
        """The vocabulary over tables already on the device (`lm_head` None: tied). A tied head
        keeps its norm apart: the lookup reads the table unscaled."""
        if lm_head is None:
            return CudaVocab(embedding, final_norm, eps, embedding)
        folded = fold and self._linear.fold_rmsnorm(final_norm, lm_head)
        return CudaVocab(embedding, None if folded else final_norm, eps, lm_head)

    # -- running --------------------------------------------------------------------------
    def embed(self, token_ids: CudaTensor, vocab: CudaVocab, out: CudaTensor) -> None:
        ops_dense.gather_rows(self._rt, vocab.embedding, token_ids, out, "embedding")

    def project(self, x: CudaTensor, projection: CudaProjection, out: CudaTensor) -> None:
        checks.rank(x, "x", 2)
        linear, rt = self._linear, self._rt
        weight, activation = projection.weight, projection.activation
        if isinstance(weight, Fp8Matrix):
            if activation is None:
                self.fp8.project(x, weight, out, projection.bias, projection.norm, projection.eps)
            else:
                self.fp8.project_gated(x, weight, out, activation, projection.norm, projection.eps)
            return
        if projection.normalized:
            normed = rt.scratch_tensor(NORMED, x.shape, x.dtype)
            if activation is None:
                linear.rmsnorm_linear(x, projection.norm, projection.eps, weight, out, normed, projection.bias)
                return
            gated = rt.scratch_tensor(PRODUCT, (x.shape[0], weight.shape[0]), out.dtype)
            linear.rmsnorm_linear(x, projection.norm, projection.eps, weight, out, normed, None, activation, gated)
        elif activation is None:
            linear(x, weight, out, projection.bias)
        else:
            gated = rt.scratch_tensor(PRODUCT, (x.shape[0], weight.shape[0]), out.dtype)
            linear(x, weight, gated, projection.bias)
            ops_dense.act_mul(rt, gated, activation, out)

    def project_add(self, x: CudaTensor, projection: CudaProjection, residual: CudaTensor) -> None:
        if projection.activation is not None:
            raise ValueError("projection: a gated activation has no residual form (use project)")
        checks.rank(residual, "residual", 2)
        if isinstance(projection.weight, Fp8Matrix):
            self.fp8.project_add(x, projection.weight, residual, projection.bias, projection.norm, projection.eps)
            return
        rt = self._rt
        delta = rt.scratch_tensor(PRODUCT, residual.shape, residual.dtype)
        if not projection.normalized and projection.bias is None:
            self._linear.linear_add(x, projection.weight, residual, delta)
            return
        self.project(x, projection, delta)
        ops_dense.add_into(rt, delta, residual)

    def logits(self, hidden: CudaTensor, vocab: CudaVocab, out: CudaTensor) -> None:
        checks.rank(hidden, "hidden", 2)
        normed = self._rt.scratch_tensor(NORMED, hidden.shape, hidden.dtype)
        self._linear.rmsnorm_linear(hidden, vocab.final_norm, vocab.eps, vocab.lm_head, out, normed)
