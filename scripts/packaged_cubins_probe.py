"""Decode attention at the Llama-3.1-8B and SmolLM2 head shapes, from wherever the cubins come
(issue 29 section 5: the 8B's first decode step traps with the packaged cubins).

    python3 scripts/packaged_cubins_probe.py [--nvcc-here DIR] [--quick]

The cubins' origin is the environment's, as in a server: ATLAS_PACKAGED_CUBINS=1 loads the
package's, ATLAS_PACKAGED_CUBINS_SKIP=attention_decode sends that module to NVRTC. `--nvcc-here
DIR` compiles attention_decode with this machine's nvcc into DIR (the prebuild's command) and
loads that cubin as the packaged one. Each case runs a prefill step and then decode steps, as
the model does, and prints its kernel, where the module came from and the error against a
float64 reference; a CUDA error poisons the context, so the first one ends the run (exit 1).
Run with CUDA_LAUNCH_BLOCKING=1 so the error names its launch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "gpu")]

from cuda_harness import (  # noqa: E402
    cuda_cache_with,
    cuda_test_backend,
    host,
    launched_symbols,
    paged_case,
    poisoned,
    reference_attention,
    rel_l2,
    upload_metadata,
)

from atlas.adapters.cuda import compiler, prebuild  # noqa: E402
from atlas.adapters.cuda.registry import KernelTarget, select_modules  # noqa: E402
from atlas.ports.gpu import DType  # noqa: E402
from atlas.ports.kernels.attention import HeadLayout  # noqa: E402

LLAMA_8B = HeadLayout(32, 8, 128)
SMOLLM2 = HeadLayout(9, 3, 64)
# (name, heads, context lengths, query lengths): prefill steps then the decode steps after them.
CASES = [
    ("8b-prefill-37", LLAMA_8B, [37], [37]),
    ("8b-decode-38", LLAMA_8B, [38], [1]),
    ("8b-decode-600", LLAMA_8B, [600], [1]),
    ("8b-decode-batch8", LLAMA_8B, [37 * i % 700 + 1 for i in range(8)], [1] * 8),
    ("8b-decode-batch24", LLAMA_8B, [53 * i % 600 + 1 for i in range(24)], [1] * 24),
    ("smollm2-decode-38", SMOLLM2, [38], [1]),
]


def nvcc_here(folder: Path, arch: str) -> Path:
    """attention_decode compiled by this machine's nvcc as the prebuild does, in a package
    folder of its own (MANIFEST.json and all); returns the cubin."""
    module = select_modules(KernelTarget("sm" + arch[3:5], "any"))["attention_decode"]
    (folder / arch).mkdir(parents=True, exist_ok=True)
    name = compiler.cubin_file_name(module, compiler.source_key(module, arch))
    command = prebuild.nvcc_command("nvcc", module, arch, folder / arch / name)
    print("nvcc here:", " ".join(command), flush=True)
    subprocess.run(command, check=True)
    version, built_with = prebuild.nvcc_cuda_version("nvcc")
    manifest = {"arches": {arch: {"cuda_version": version, "built_with": built_with, "cubins": {}}}}
    (folder / compiler.MANIFEST_NAME).write_text(json.dumps(manifest))
    return folder / arch / name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvcc-here", type=Path, help="compile attention_decode with nvcc here into this folder")
    parser.add_argument("--quick", action="store_true", help="only the 8B's prefill and first decode step")
    args = parser.parse_args()
    arch = "sm_90a"
    if args.nvcc_here:
        built = nvcc_here(args.nvcc_here, arch)
        shipped = next((compiler.packaged_root() / arch).glob("attention_decode-*.cubin"), None)
        digest = hashlib.sha256(built.read_bytes()).hexdigest()[:16]
        same = shipped is not None and shipped.read_bytes() == built.read_bytes()
        print(f"nvcc here: {built.name} sha256 {digest}; identical to the shipped cubin: {same}", flush=True)
        compiler.packaged_root = lambda: args.nvcc_here  # the runtime's packaged_cubins() reads it
    backend = cuda_test_backend(Path(tempfile.mkdtemp(prefix="atlas-probe-cache-")))
    rt = backend.runtime
    rt.kernels.wait()
    stats = rt.kernels.compiler.stats
    print(f"device {rt.device_name}, arch {rt.arch}; modules: {stats.describe()}; "
          f"attention_decode: {'packaged' if 'attention_decode' in stats.packaged else 'NVRTC or cache'}", flush=True)
    rng = np.random.default_rng(0)
    failed = 0
    for name, heads, context_lens, query_lens in CASES[:2] if args.quick else CASES:
        try:
            case = paged_case(rng, heads, context_lens, query_lens, block_size=16)
            scale = 1 / math.sqrt(heads.head_dim)
            kv = cuda_cache_with(backend, case)
            meta = upload_metadata(backend, case)
            out = poisoned(backend, (case.num_tokens, heads.q_size), DType.BF16)
            q = backend.upload(case.query, DType.BF16)
            symbols = launched_symbols(backend, lambda: backend.paged_attention(q, kv, 0, meta, heads, scale, out))
            backend.synchronize()
            error = rel_l2(host(backend, out), reference_attention(case, scale, None))
            verdict = "ok" if error < 1e-2 else "WRONG"
            failed += verdict != "ok"
            print(f"{name}: {verdict} rel_l2 {error:.2e} ({', '.join(symbols)})", flush=True)
        except Exception as caught:  # a trap poisons the context: report and stop
            print(f"{name}: FAILED {type(caught).__name__}: {caught}", flush=True)
            traceback.print_exc()
            return 1
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], check=False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
