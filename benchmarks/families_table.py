"""The table of benchmarks/families_gpu.sh: `python3 benchmarks/families_table.py OUT_DIR`.

Reads what the run left in OUT_DIR (gpu.txt, steps.txt, outcomes.txt from the pytest_outcomes
plugin, families.log, and the `atlas bench --json` files moe.json, next.json, dense.json) and
prints issue 30's checks: each family's fidelity test with its worst error against transformers'
own bf16 error, atlas doctor per family, the contract suite's counts, then the speed figures of
"What must hold" 4 beside their targets. A step that did not run or finish shows as missing.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

# docs/benchmarks.md: Llama-3.1-8B on an H200 (copy 4.15 TB/s), the figures to stay within 2% of
DENSE_H200 = {"batch 1 step ms": 3.833, "batch 64 step ms": 5.591, "8k prefill s": 0.2425}
_ERROR_LINE = re.compile(r"^(\w+) step (\d+) \(lens [\d,]+\): atlas (\S+) transformers-bf16 (\S+)$")
_MODEL_TYPES = {"qwen3-30b-a3b": "qwen3_moe", "qwen3-next": "qwen3_next", "gemma3": "gemma3_text", "gpt-oss": "gpt_oss"}


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _outcomes(out: Path) -> list[tuple[str, str]]:
    """(outcome, test id) of every finished test, in order."""
    rows = []
    for line in _read(out / "outcomes.txt").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            rows.append((parts[0], parts[2]))
    return rows


def _worst_ratios(log: str) -> dict[str, float]:
    """Per model type, the largest Atlas error / transformers bf16 error of a step."""
    worst: dict[str, float] = {}
    for line in log.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match:
            ratio = float(match.group(3)) / float(match.group(4))
            worst[match.group(1)] = max(worst.get(match.group(1), 0.0), ratio)
    return worst


def _fidelity(out: Path) -> list[str]:
    outcomes = _outcomes(out)
    worst = _worst_ratios(_read(out / "families.log"))
    lines = []
    for outcome, test in outcomes:
        if "families_prefill_decode_and_chunk" in test:
            family = test.rsplit("[", 1)[-1].rstrip("]")
            model_type = next((t for prefix, t in _MODEL_TYPES.items() if family.startswith(prefix)), "")
            ratio = f"worst error {worst[model_type]:.2f}x transformers' bf16 (bound 1.5x)" if model_type in worst else ""
            lines.append(f"  {family:<26} prefill, decode, batch, chunks  {outcome:<7} {ratio}")
        elif "test_doctor_cuda" in test:
            family = test.rsplit("[", 1)[-1].rstrip("]")
            lines.append(f"  atlas doctor {family:<13} every layer within 3x bf16 noise  {outcome}")
    contract = [outcome for outcome, test in outcomes if test.startswith("tests/contract")]
    if contract:
        counts = {name: contract.count(name) for name in ("passed", "failed", "skipped")}
        lines.append(f"  contract suite on CUDA: {counts['passed']} passed, {counts['failed']} failed, "
                     f"{counts['skipped']} skipped")
    kinds = [outcome for outcome, test in outcomes if "test_cuda_moe" in test or "test_cuda_recurrent" in test]
    if kinds:
        lines.append(f"  MoE / recurrent kinds against the mock: {kinds.count('passed')} passed, "
                     f"{kinds.count('failed')} failed")
    return lines or ["  (no test finished)"]


def _report(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _decode(report: dict | None, batch: int) -> dict | None:
    return next((row for row in (report or {}).get("decode", []) if row["batch"] == batch), None)


def _prefill(report: dict | None, tokens: int = 8192) -> dict | None:
    return next((row for row in (report or {}).get("prefill", []) if row["tokens"] == tokens), None)


def _row(label: str, figure: str, target: str, holds: bool | None) -> str:
    verdict = "-" if holds is None else ("holds" if holds else "MISSES")
    return f"  {label:<52} {figure:>16}  {target:<12} {verdict}"


def _speed(out: Path, device: str) -> list[str]:
    moe, nxt, dense = _report(out, "moe"), _report(out, "next"), _report(out, "dense")
    lines = []
    for report, label in ((moe, "Qwen3-30B-A3B"), (nxt, "Qwen3-Next")):
        if report is None:
            lines.append(_row(f"{label}: no figures (see its log)", "", "", None))
            continue
        name = f"{label} ({Path(report['model_dir']).name})"
        one = _decode(report, 1)
        if one:
            lines.append(_row(f"{name} batch 1, of the roofline", f"{100 * one['roofline_fraction']:.1f}%",
                              ">= 70%", one["roofline_fraction"] >= 0.70))
            lines.append(f"      step {one['step_ms']:.3f} ms (device {one['device_step_ms']:.3f}), "
                         f"reads {one['read_gb']:.2f} GB")
        many = _decode(report, 64)
        if many:
            ratio = many["step_ms"] / many["roofline_step_ms"]
            lines.append(_row(f"{name} batch 64, step / (bytes / bandwidth)", f"{ratio:.2f}x", "<= 1.25x",
                              ratio <= 1.25))
            lines.append(f"      step {many['step_ms']:.3f} ms (device {many['device_step_ms']:.3f}), "
                         f"reads {many['read_gb']:.2f} GB")
        prefill = _prefill(report)
        if prefill and "speedup_vs_reference" in prefill:
            speedup = prefill["speedup_vs_reference"]
            lines.append(_row(f"{label} 8k prefill, transformers s / Atlas s", f"{speedup:.2f}x", ">= 1x", speedup >= 1))
            lines.append(f"      Atlas {prefill['seconds']:.3f} s, transformers {prefill['reference_seconds']:.3f} s")
        elif prefill:
            lines.append(_row(f"{label} 8k prefill (no transformers figure)", f"{prefill['seconds']:.3f} s", "", None))
    if dense is None:
        lines.append(_row("Llama-3.1-8B: no figures (see its log)", "", "", None))
        return lines
    baseline = DENSE_H200 if "H200" in device else None
    one, many, prefill = _decode(dense, 1), _decode(dense, 64), _prefill(dense)
    figures = {"batch 1 step ms": one and one["step_ms"], "batch 64 step ms": many and many["step_ms"],
               "8k prefill s": prefill and prefill["seconds"]}
    for label, value in figures.items():
        if value is None:
            continue
        if baseline is None:
            lines.append(_row(f"Llama-3.1-8B {label} (no baseline for this GPU)", f"{value:.4g}", "", None))
            continue
        change = value / baseline[label] - 1
        lines.append(_row(f"Llama-3.1-8B {label} (docs, H200: {baseline[label]})", f"{value:.4g} ({100 * change:+.1f}%)",
                          "within 2%", change <= 0.02))
    return lines


def main(out: Path) -> int:
    device = _read(out / "gpu.txt").strip().splitlines()[0] if _read(out / "gpu.txt").strip() else "?"
    print(f"=== issue 30 on {device}")
    steps = [line.split() for line in _read(out / "steps.txt").splitlines() if line.strip()]
    print("steps: " + ", ".join(f"{name} {'skipped' if rc == 'skipped' else f'rc={rc} {s}s'}" for name, rc, s in steps))
    print("fidelity (what must hold 2 and 3)")
    print("\n".join(_fidelity(out)))
    print(f"speed (what must hold 4){'':<30} {'figure':>16}  {'target':<12}")
    print("\n".join(_speed(out, device)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 benchmarks/families_table.py OUT_DIR")
    sys.exit(main(Path(sys.argv[1])))
