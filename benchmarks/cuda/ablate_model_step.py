"""What each kind of kernel costs inside a captured decode step (not a test; prints a table).

Run: python benchmarks/cuda/ablate_model_step.py [batch ...] [attention | gemm]   (default: 1 64;
`attention`: only the decode attention variants; `gemm`: only the linear variants past 8 rows)

ncu times kernels one by one, without the overlap programmatic dependent launch gives a graph
(each kernel's weight loads run under its predecessor's tail), so its times do not add up to the
step. Here the Llama-3.1-8B step of bench_model_step.py (random weights, 512-token contexts) is
captured again with one kind of kernel left out and replayed: the difference to the whole step
is what that kind costs in place. The outputs are wrong without the kernels left out; only the
time is meant.
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import replace

import numpy as np
from bench_model_step import Events, RandomFill, copy_rate, decode_step_us, llama_8b_with_kv

from atlas.adapters.cuda import CudaGpuBackend, ops_attention, ops_dense

# What to leave out: (module, function) pairs replaced by a no-op during capture.
_LEFT_OUT = {
    "RMSNorm kernels": [(ops_dense, "rmsnorm")],
    "RoPE + cache write kernel": [(ops_attention, "rope_and_cache")],
    "decode attention": [(ops_attention, "attention")],
    "residual adds (add_into)": [(ops_dense, "add_into")],
    "act_mul": [(ops_dense, "act_mul")],
}


# The Llama-3.1-8B projections by (weight rows, inner width, kernel form).
_PROJECTIONS = {
    "qkv": lambda rows, inner, what: rows == 6144,
    "o": lambda rows, inner, what: what == "add" and inner == 4096,
    "gate_up": lambda rows, inner, what: what.startswith("gated"),
    "down": lambda rows, inner, what: inner == 14336,
    "LM head": lambda rows, inner, what: rows > 100000,
}


def _noop(*args, **kwargs) -> None:
    return None


def _without(stack: ExitStack, pairs) -> None:
    for module, name in pairs:
        original = getattr(module, name)
        setattr(module, name, _noop)
        stack.callback(setattr, module, name, original)


def main(argv: list[str]) -> int:
    batches = [int(b) for b in argv if b.isdigit()] or [1, 64]
    attention_only = "attention" in argv  # only the decode attention variants
    gemm_only = "gemm" in argv  # only the skinny GEMM variants
    backend = CudaGpuBackend()
    events = Events(backend)
    bandwidth = copy_rate(backend, events)
    fill = RandomFill(backend, np.random.default_rng(0), 0.02)
    model, kv = llama_8b_with_kv(backend, fill, max(batches))

    variants = [("whole step", [], True)]
    if not (attention_only or gemm_only):
        variants.append(("greedy sampling", [], False))
        variants += [(name, pairs, True) for name, pairs in _LEFT_OUT.items()]
        variants.append(("all of the above", [p for pairs in _LEFT_OUT.values() for p in pairs], False))
    table: dict[str, dict[int, float]] = {}
    for name, pairs, sample in variants:
        with ExitStack() as stack:
            _without(stack, pairs)
            table[name] = {b: decode_step_us(backend, events, fill, model, kv, b, 512, sample) for b in batches}
    # Linear past 8 rows: cuBLASLt or the skinny GEMM, every projection, then one kind at a time.
    gemm = {}
    saved_features = backend.runtime.features
    if not attention_only:
        backend.runtime.features = replace(saved_features, skinny_gemm=False)
        gemm["cuBLASLt"] = {b: decode_step_us(backend, events, fill, model, kv, b, 512) for b in batches}
        backend.runtime.features = replace(saved_features, skinny_gemm=True)
        gemm["skinny"] = {b: decode_step_us(backend, events, fill, model, kv, b, 512) for b in batches}
        # One kind of projection at a time on the skinny GEMM, the rest on cuBLASLt.
        skinny = ops_dense.LinearOp._skinny
        for kind, takes in _PROJECTIONS.items():

            def only(self, x, weight, out, bias, what, gated=False, takes=takes):
                rows = out.shape[1] * (2 if gated else 1)
                return takes(rows, x.shape[1], what) and skinny(self, x, weight, out, bias, what, gated)

            ops_dense.LinearOp._skinny = only
            gemm[f"skinny for {kind} only"] = {
                b: decode_step_us(backend, events, fill, model, kv, b, 512) for b in batches
            }
        ops_dense.LinearOp._skinny = skinny
        backend.runtime.features = saved_features
    # Decode attention: which kernel, and its splits (tokens per split at least).
    splits = {}
    saved_tokens = dict(ops_attention.MIN_TOKENS_PER_SPLIT)
    for kernel in ("mma", "simt") if not gemm_only else ():
        backend.runtime.features = replace(saved_features, mma_decode=kernel == "mma")
        for tokens in (32, 64, 128):
            ops_attention.MIN_TOKENS_PER_SPLIT[kernel] = tokens
            splits[f"{kernel}, {tokens} tokens"] = {b: decode_step_us(backend, events, fill, model, kv, b, 512) for b in batches}
        ops_attention.MIN_TOKENS_PER_SPLIT[kernel] = saved_tokens[kernel]
    backend.runtime.features = saved_features
    print(f"device: {backend.capabilities.device_name}, copy {bandwidth / 1e12:.2f} TB/s")
    print("Llama-3.1-8B decode step at a 512-token context; device us per step (graph replays)")
    header = "".join(f"  {'b' + str(b):>8}  {'saves':>7}" for b in batches)
    print(f"{'left out':<28}{header}")
    whole = table["whole step"]
    for name, times in table.items():
        cells = "".join(
            f"  {times[b]:>8.0f}  {'' if name == 'whole step' else f'{whole[b] - times[b]:7.0f}'}" for b in batches
        )
        print(f"{name:<28}{cells}")
    print("linear past 8 token rows: cuBLASLt (the default) or the skinny GEMM (skinny_gemm)")
    for name, times in gemm.items():
        print(f"{name:<36}" + "".join(f"  {times[b]:>8.0f}" for b in batches))
    print(f"decode attention: kernel, tokens per split at least (now {saved_tokens}); whole step")
    for tokens, times in splits.items():
        print(f"{tokens:<28}" + "".join(f"  {times[b]:>8.0f}  {'':7}" for b in batches))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
