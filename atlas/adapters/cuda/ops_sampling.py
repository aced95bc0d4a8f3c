"""The sampling kind on CUDA: one block per row runs the whole rule chain of `SamplingTensors`
on the device (the allowed-token mask tested as the logits are read); only the token ids (and
logprobs when asked) are written out."""

from __future__ import annotations

import numpy as np

from atlas.adapters.cuda import checks
from atlas.adapters.cuda.runtime import CudaRuntime
from atlas.adapters.cuda.tensor import CudaTensor
from atlas.ports.gpu import DType
from atlas.ports.kernels.sampling import LogprobsOut, SamplingTensors

_THREADS = 1024
_RADIX_BINS = 256
# Per-warp float64 top-p histograms in dynamic shared memory (see sampling.cu).
_SHARED_BYTES = (_THREADS // 32) * _RADIX_BINS * 8

_PER_ROW = (
    ("temperature", DType.F32),
    ("top_k", DType.I32),
    ("top_p", DType.F32),
    ("min_p", DType.F32),
    ("seeds", DType.I64),
    ("counters", DType.I64),
    ("repetition_penalty", DType.F32),
    ("presence_penalty", DType.F32),
    ("frequency_penalty", DType.F32),
)
_CSR = (
    ("penalty_offsets", DType.I32),
    ("penalty_token_ids", DType.I32),
    ("penalty_output_counts", DType.I32),
    ("bias_offsets", DType.I32),
    ("bias_token_ids", DType.I32),
    ("bias_values", DType.F32),
)


def _field(params: SamplingTensors, name: str) -> CudaTensor:
    tensors = {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "seeds": params.seeds,
        "counters": params.counters,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "penalty_offsets": params.penalty_offsets,
        "penalty_token_ids": params.penalty_token_ids,
        "penalty_output_counts": params.penalty_output_counts,
        "bias_offsets": params.bias_offsets,
        "bias_token_ids": params.bias_token_ids,
        "bias_values": params.bias_values,
    }
    return checks.tensor(tensors[name], f"params.{name}")


def _check(logits: CudaTensor, params: SamplingTensors, out_token_ids: CudaTensor, logprobs: LogprobsOut | None):
    num_rows = params.num_rows
    checks.rank(logits, "logits", 2)
    checks.dtype(logits, "logits", (DType.F32, DType.BF16))
    checks.at_least_rows(logits, "logits", num_rows)
    checks.dtype(out_token_ids, "out_token_ids", (DType.I32,))
    checks.at_least_rows(out_token_ids, "out_token_ids", num_rows)
    for name, dtype in _PER_ROW:
        tensor = _field(params, name)
        checks.dtype(tensor, f"params.{name}", (dtype,))
        checks.at_least_rows(tensor, f"params.{name}", num_rows)
    for name, dtype in _CSR:
        checks.dtype(_field(params, name), f"params.{name}", (dtype,))
    checks.at_least_rows(params.penalty_offsets, "params.penalty_offsets", num_rows + 1)
    checks.at_least_rows(params.bias_offsets, "params.bias_offsets", num_rows + 1)
    if params.token_mask is not None:
        mask = checks.tensor(params.token_mask, "params.token_mask")
        checks.rank(mask, "params.token_mask", 2)
        checks.dtype(mask, "params.token_mask", (DType.I32,))
        checks.at_least_rows(mask, "params.token_mask", num_rows)
        words = (logits.shape[1] + 31) // 32
        if mask.shape[1] != words:
            raise ValueError(f"params.token_mask: {mask.shape[1]} words a row, the vocabulary of {logits.shape[1]} "
                             f"needs {words}")
    if logprobs is not None:
        checks.dtype(logprobs.sampled, "logprobs.sampled", (DType.F32,))
        checks.at_least_rows(logprobs.sampled, "logprobs.sampled", num_rows)
        if logprobs.num_top:
            if logprobs.num_top > logits.shape[1]:
                raise ValueError(f"logprobs.num_top: {logprobs.num_top} is over the vocabulary of {logits.shape[1]}")
            for name, value, dtype in (
                ("top_ids", logprobs.top_ids, DType.I32),
                ("top_logprobs", logprobs.top_logprobs, DType.F32),
            ):
                checks.dtype(value, f"logprobs.{name}", (dtype,))
                checks.at_least_rows(value, f"logprobs.{name}", num_rows)
                if value.shape[1:] != (logprobs.num_top,):
                    raise ValueError(f"logprobs.{name}: shape {list(value.shape)} is not [R, {logprobs.num_top}]")


def sample(
    rt: CudaRuntime,
    logits: CudaTensor,
    params: SamplingTensors,
    out_token_ids: CudaTensor,
    logprobs: LogprobsOut | None,
) -> None:
    """Write one token id per row (see `SamplingTensors` for the rules and the random stream)."""
    _check(logits, params, out_token_ids, logprobs)
    num_rows = params.num_rows
    if num_rows == 0:
        return
    vocab_size = logits.shape[1]
    workspace = rt.workspace("sampling_rows", num_rows * vocab_size * 4)
    num_top = logprobs.num_top if logprobs is not None else 0
    sampled = checks.address(logprobs.sampled, "logprobs.sampled") if logprobs is not None else 0
    top_ids = checks.address(logprobs.top_ids, "logprobs.top_ids") if logprobs is not None and num_top else 0
    top_logprobs = (
        checks.address(logprobs.top_logprobs, "logprobs.top_logprobs") if logprobs is not None and num_top else 0
    )
    rt.launch(
        "sampling",
        f"sample_{checks.type_suffix(logits.dtype)}",
        (num_rows,),
        _THREADS,
        logits.address,
        np.int32(vocab_size),
        workspace,
        *(_field(params, name).address for name, _ in _PER_ROW),
        *(_field(params, name).address for name, _ in _CSR),
        params.token_mask.address if params.token_mask is not None else 0,
        np.int32((vocab_size + 31) // 32),
        np.int32(params.any_penalties),
        np.int32(params.any_bias),
        np.int32(params.all_greedy),
        out_token_ids.address,
        sampled,
        top_ids,
        top_logprobs,
        np.int32(num_top),
        shared_bytes=_SHARED_BYTES,
    )


class CudaSampling:
    """`SamplingKernels` on one GPU."""

    def __init__(self, rt: CudaRuntime) -> None:
        self._rt = rt

    def sample(
        self,
        logits: CudaTensor,
        params: SamplingTensors,
        out_token_ids: CudaTensor,
        logprobs: LogprobsOut | None = None,
    ) -> None:
        sample(self._rt, logits, params, out_token_ids, logprobs)
