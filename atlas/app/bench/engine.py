"""`atlas bench engine`: decode and prefill throughput against the device's own ceilings.

One run measures, on the same device and in the same process: the copy bandwidth and bf16
GEMM rate; decode tokens/s at each batch size with a fixed context, as a fraction of the
roofline ((weight + KV bytes read per step) / bandwidth), with the host gap between steps;
prefill tokens/s and the fraction of the GEMM rate for each prompt length; TTFT. With
`--reference hf` the same checkpoint runs through transformers first (in its own process) and
the table shows the ratios. Output: a table on stdout, and optionally JSON and a PNG plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from atlas.app.bench.measure import (
    GB,
    BytesRead,
    Ceilings,
    DecodeResult,
    PrefillResult,
    engine_bytes_read,
    measure_ceilings,
    measure_decode,
    measure_prefill,
)
from atlas.app.builder import build_engine
from atlas.app.long_running import freeze_startup_objects
from atlas.app.settings import EngineSettings

REFERENCE_SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "hf_reference.py"


def run_engine_bench(args: argparse.Namespace, settings: EngineSettings) -> int:
    model = _model_folder(args, fp8=settings.quantization == "fp8")
    if args.random:  # an FP8 random checkpoint is written as FP8 (the per-channel layout), not quantized at load
        settings = dataclasses.replace(settings, quantization="none")
    batch_sizes = _sizes(args.batch_sizes, "--batch-sizes")
    if args.rounds < 1:
        raise ValueError(f"--rounds needs a positive integer (got {args.rounds})")
    reference = _run_reference(model, args) if args.reference != "none" else None
    prefill_lens = _sizes(args.prefill_lens, "--prefill-lens") if args.prefill_lens else _default_prefill(settings)
    settings = dataclasses.replace(
        settings,
        model=str(model),
        max_num_seqs=max(settings.max_num_seqs, max(batch_sizes)),
        max_batch_size=max(settings.max_batch_size or 0, max(batch_sizes)),
        max_prefill_tokens=max(settings.max_prefill_tokens, max(prefill_lens, default=0)),
        max_seq_len=settings.max_seq_len or max(max(prefill_lens, default=0), args.context + 5 * args.decode_tokens + 64) + 16,
    )
    engine = build_engine(settings)
    freeze_startup_objects()  # as a server's engine process does
    try:
        return _bench(engine, args, model, batch_sizes, prefill_lens, reference)
    finally:
        engine.close()


def _bench(engine, args: argparse.Namespace, model, batch_sizes: list[int], prefill_lens: list[int],
           reference: dict | None) -> int:
    ranks = engine.settings.tensor_parallel_size if engine.ranks is not None else 1
    if engine.ranks is not None:  # a model on rank processes: each rank measures its device and part
        print(f"measuring the {ranks} ranks' devices and collectives ...", file=sys.stderr)
        measures = engine.ranks.measure(batch_sizes)
        device = f"{ranks} ranks of {measures[0].device_name}"
        ceilings = Ceilings(min(m.copy_bytes_per_s for m in measures), min(m.gemm_flops_per_s for m in measures))
        bytes_read = BytesRead(max(m.weight_bytes_per_step for m in measures),
                               max(m.kv_bytes_per_token for m in measures))
        collective_s = [max(m.collective_s[index] for m in measures) for index in range(len(batch_sizes))]
    else:
        on_mock = engine.backend.name == "mock"
        device = engine.backend.capabilities.device_name
        ceilings = measure_ceilings(engine.backend, copy_bytes=(256 << 20) if on_mock else (2 << 30),
                                    gemm_size=1024 if on_mock else 8192)
        bytes_read, collective_s = engine_bytes_read(engine), [0.0] * len(batch_sizes)
    print(f"atlas bench engine: {engine.config.architecture} from {model} on {device}", file=sys.stderr)
    if engine.settings.speculative_config:
        from atlas.app.bench.speculative import run_speculative_bench

        report = {"device": device,
                  **run_speculative_bench(engine, args.prompts, batch_sizes, args.decode_tokens, args.rounds)}
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    if args.json_schema:
        from atlas.app.bench.structured import run_structured_bench

        report = {"device": device,
                  **run_structured_bench(engine, args.json_schema, batch_sizes, args.decode_tokens, args.rounds)}
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
        return 0
    decode = []
    for batch in batch_sizes:
        print(f"decode at batch {batch} ...", file=sys.stderr)
        decode.append(measure_decode(engine, batch, args.context, args.decode_tokens, ceilings.copy_bytes_per_s,
                                     bytes_read=bytes_read))
    prefill = []
    for num_tokens in prefill_lens:
        print(f"prefill of {num_tokens} tokens ...", file=sys.stderr)
        prefill.append(measure_prefill(engine, num_tokens))
    report = _report(engine, device, ceilings, decode, prefill, reference, bytes_read, ranks, collective_s)
    _print(report)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot_path:
        _plot(report, args.plot_path)
    return 0


def _default_prefill(settings: EngineSettings) -> list[int]:
    """512, 2048 and 8192-token prompts on a GPU; none on the mock (minutes each on a CPU)."""
    from atlas.app.backends import cuda_available

    on_gpu = settings.device == "cuda" or (settings.device == "auto" and cuda_available())
    return [512, 2048, 8192] if on_gpu else []


def _model_folder(args: argparse.Namespace, fp8: bool) -> Path | str:
    """The model to bench; `--random` with `fp8` (`--quantization fp8`) writes the random
    checkpoint's projections as FP8 tensors (compressed-tensors, per channel), in a folder of
    its own."""
    if args.random:
        from atlas.app.bench.random_model import CONFIGS, write_random_model
        from atlas.app.model_store import atlas_home

        if args.random not in CONFIGS:
            raise ValueError(f"--random {args.random!r} is not a known config; known: {', '.join(CONFIGS)}")
        # transformers reads files; Atlas alone generates bf16 weights as it loads them (FP8 ones are written)
        folder = atlas_home() / "bench" / (args.random + ("-fp8" if fp8 else ""))
        return write_random_model(args.random, folder, files=args.reference == "hf" or fp8, fp8=fp8)
    if not args.model:
        raise ValueError("atlas bench engine needs a MODEL or --random CONFIG (e.g. --random llama-3.1-8b)")
    from atlas.app.model_store import resolve_model

    return resolve_model(args.model)


def _sizes(text: str, flag: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, e.g. 1,8,64 (got {text!r})") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"{flag} needs positive integers, e.g. 1,8,64 (got {text!r})")
    return sizes


def _run_reference(model: Path | str, args: argparse.Namespace) -> dict | None:
    """transformers on the same folder (`hf-random`: on its config, weights drawn on the device),
    before Atlas takes the device's memory; None (and a message) where it fails."""
    if not REFERENCE_SCRIPT.exists():
        raise ValueError(f"--reference hf needs {REFERENCE_SCRIPT} (run from a checkout of the repository)")
    command = [sys.executable, str(REFERENCE_SCRIPT), "--model", str(model), "--batch-sizes",
               args.reference_batch_sizes, "--context", str(args.context), "--decode-tokens",
               str(args.decode_tokens), "--prefill-lens", args.prefill_lens or "512,2048,8192"]
    if args.reference == "hf-random":
        command.append("--random-weights")
    print("running the transformers reference (compiling takes minutes) ...", file=sys.stderr)
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:  # Atlas's own figures are still worth the run
        print(f"the transformers reference failed (exit {result.returncode}; its messages are above): "
              "the table has no reference column", file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report(engine, device, ceilings: Ceilings, decode: list[DecodeResult], prefill: list[PrefillResult],
            reference: dict | None, bytes_read: BytesRead, ranks: int, collective_s: list[float]) -> dict:
    """On several ranks the roofline is a rank's (its weight and KV bytes over its bandwidth),
    `collective_ms` the time a decode step's collectives take on their own, and the GEMM
    fraction of a prefill counts every rank's GEMM rate."""
    reference_decode = {row["batch"]: row for row in (reference or {}).get("decode", [])}
    reference_prefill = {row["num_tokens"]: row for row in (reference or {}).get("prefill", [])}
    decode_rows = []
    for row, collectives in zip(decode, collective_s):
        entry = {
            "batch": row.batch, "context": row.context_len, "mean_context": row.mean_context,
            "tokens_per_s": row.tokens_per_s,
            "step_ms": 1e3 * row.step_s, "device_step_ms": 1e3 * row.device_step_s,
            "host_gap_fraction": row.host_gap_fraction, "roofline_step_ms": 1e3 * row.roofline_step_s,
            "roofline_fraction": row.roofline_fraction, "collective_ms": 1e3 * collectives,
            "read_gb": row.roofline_step_s * ceilings.copy_bytes_per_s / GB,
        }
        if row.batch in reference_decode:
            entry["reference_tokens_per_s"] = reference_decode[row.batch]["tokens_per_s"]
            entry["speedup_vs_reference"] = row.tokens_per_s / entry["reference_tokens_per_s"]
        decode_rows.append(entry)
    prefill_rows = []
    for row in prefill:
        entry = {
            "tokens": row.num_tokens, "seconds": row.seconds, "tokens_per_s": row.tokens_per_s,
            "tflops": row.flops / row.seconds / 1e12,
            "gemm_rate_fraction": row.flops / row.seconds / (ranks * ceilings.gemm_flops_per_s),
        }
        if row.num_tokens in reference_prefill:
            entry["reference_seconds"] = reference_prefill[row.num_tokens]["seconds"]
            entry["speedup_vs_reference"] = entry["reference_seconds"] / row.seconds
        prefill_rows.append(entry)
    by_batch = {row.batch: row for row in decode}
    return {
        "device": device,
        "model": engine.config.architecture,
        "model_dir": str(engine.model_dir),
        "kv_cache_dtype": engine.settings.kv_cache_dtype if ranks > 1 else engine.core.executor.kv_dtype.value,
        "ranks": ranks,
        "weights": _weights_format(engine),
        "weight_gb_per_step": (bytes_read.weight_bytes + bytes_read.experts_read(1)) / GB,  # at batch 1
        "routed_expert_gb": bytes_read.expert_bytes / GB,
        "experts": [bytes_read.num_experts, bytes_read.top_k],
        "state_mb_per_sequence": bytes_read.state_bytes_per_sequence / 1e6,
        "copy_tb_per_s": ceilings.copy_bytes_per_s / 1e12,
        "gemm_tflops": ceilings.gemm_flops_per_s / 1e12,
        "decode": decode_rows,
        "step_ratio_64_vs_1": by_batch[64].step_s / by_batch[1].step_s if 1 in by_batch and 64 in by_batch else None,
        "prefill": prefill_rows,
        "ttft_512_ms": next((1e3 * r.seconds for r in prefill if r.num_tokens == 512), None),
        "reference": reference,
    }


def _weights_format(engine) -> str:
    from atlas.domain.models.quantization_config import read_quantization

    quantization = read_quantization(engine.config.raw)
    return "bf16" if quantization is None else quantization.describe()


def _print(report: dict) -> None:
    per_rank = " per rank" if report["ranks"] > 1 else ""
    print(f"device {report['device']}; {report['model']}, {report['weights']} weights, "
          f"{report['kv_cache_dtype']} KV cache; "
          f"weights read per decode step{per_rank} {report['weight_gb_per_step']:.2f} GB; "
          f"copy {report['copy_tb_per_s']:.2f} TB/s; "
          f"bf16 GEMM {report['gemm_tflops']:.1f} TFLOP/s{per_rank}")
    collectives = f" {'coll ms':>8}" if report["ranks"] > 1 else ""
    print(f"{'batch':>5} {'context':>7} {'tok/s':>10} {'step ms':>8} {'device ms':>9} {'host gap':>8} {'roofline':>8} "
          f"{'vs ref':>7}{collectives}")
    for row in report["decode"]:
        vs = f"{row['speedup_vs_reference']:.2f}x" if "speedup_vs_reference" in row else "-"
        coll = f" {row['collective_ms']:>8.3f}" if report["ranks"] > 1 else ""
        print(f"{row['batch']:>5} {row['mean_context']:>7.1f} {row['tokens_per_s']:>10.1f} {row['step_ms']:>8.3f} "
              f"{row['device_step_ms']:>9.3f} {100 * row['host_gap_fraction']:>7.1f}% {100 * row['roofline_fraction']:>7.1f}% "
              f"{vs:>7}{coll}")
    experts, top_k = report["experts"]
    if experts or report["state_mb_per_sequence"]:
        print(f"roofline: the step's bytes over the copy bandwidth: the weights but the routed experts, the "
              f"{report['routed_expert_gb']:.2f} GB of routed experts ({top_k} of {experts} a token) times "
              f"1 - (1 - k/E)^batch (uniform routing), KV, and {report['state_mb_per_sequence']:.1f} MB of "
              f"recurrent state a sequence (read + written); GB a step: "
              + ", ".join(f"batch {row['batch']} {row['read_gb']:.2f}" for row in report["decode"]))
    if report["ranks"] > 1:
        print(f"roofline: one rank's weight and KV bytes over its copy bandwidth; coll ms: the step's "
              f"{report['ranks']}-rank all-reduces and logits all-gather on their own")
    if report["step_ratio_64_vs_1"] is not None:
        print(f"batch-64 step / batch-1 step: {report['step_ratio_64_vs_1']:.2f}")
    if report["prefill"]:
        print(f"{'prompt':>6} {'seconds':>8} {'tok/s':>9} {'TFLOP/s':>8} {'of GEMM':>8} {'vs ref':>7}")
        for row in report["prefill"]:
            vs = f"{row['speedup_vs_reference']:.2f}x" if "speedup_vs_reference" in row else "-"
            print(f"{row['tokens']:>6} {row['seconds']:>8.4f} {row['tokens_per_s']:>9.0f} {row['tflops']:>8.1f} "
                  f"{100 * row['gemm_rate_fraction']:>7.1f}% {vs:>7}")
    if report["ttft_512_ms"] is not None:
        print(f"TTFT, 512-token prompt: {report['ttft_512_ms']:.1f} ms")


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install 'atlas[bench]'); skipped", file=sys.stderr)
        return
    batches = [row["batch"] for row in report["decode"]]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(batches, [row["tokens_per_s"] for row in report["decode"]], "o-", label="Atlas")
    axes.plot(batches, [b / (row["roofline_step_ms"] / 1e3) for b, row in zip(batches, report["decode"])], "--",
              label="roofline (bytes read / copy bandwidth)")
    reference = [(row["batch"], row["reference_tokens_per_s"]) for row in report["decode"] if "reference_tokens_per_s" in row]
    if reference:
        axes.plot(*zip(*reference), "s", label="transformers (static cache + compile)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("decode batch size")
    axes.set_ylabel("output tokens/s")
    axes.set_title(f"{report['model']} on {report['device']}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
