"""Build the packaged cubins: `python -m atlas.adapters.cuda.prebuild [--arch sm_90a ...] [--check]`.

Compiles every kernel module some target of each arch can select (`registry.selectable_modules`)
with nvcc into `atlas/adapters/cuda/cubins/<arch>/<module>-<source key>.cubin`, removes the cubins
no current source maps to, and writes `cubins/MANIFEST.json`: per arch the CUDA version that built
them (the driver must support it) and each file's module, source and SHA-256. The runtime finds a
cubin by the source key alone (compiler.py), so a kernel edited without rebuilding falls back to
NVRTC; `--check` lists such modules and exits 1. Needs nvcc (no GPU); run it after editing
anything under kernels/ and commit the result.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from atlas.adapters.cuda.compiler import MANIFEST_NAME, cubin_file_name, packaged_root, source_key
from atlas.adapters.cuda.registry import KernelModule, family_of_arch, kernels_root, selectable_modules

DEFAULT_ARCHES = ("sm_90a", "sm_100a")
# cuda.core ProgramOptions fields a KERNELS.toml may set, as nvcc spells them. A module with any
# other option is left to NVRTC (not packaged).
_NVCC_OPTIONS = {
    "max_register_count": lambda value: [f"--maxrregcount={int(value)}"],
    "ftz": lambda value: [f"--ftz={'true' if value else 'false'}"],
    "prec_div": lambda value: [f"--prec-div={'true' if value else 'false'}"],
    "prec_sqrt": lambda value: [f"--prec-sqrt={'true' if value else 'false'}"],
    "fma": lambda value: [f"--fmad={'true' if value else 'false'}"],
    "use_fast_math": lambda value: ["--use_fast_math"] if value else [],
    "lineinfo": lambda value: ["-lineinfo"] if value else [],
}


@dataclass(frozen=True, slots=True)
class PlannedCubin:
    module: KernelModule
    arch: str
    file_name: str


def planned_cubins(arch: str, root: Path | None = None) -> list[PlannedCubin]:
    """The cubin every selectable module of `arch` should have, named by its current source."""
    modules = selectable_modules(family_of_arch(arch), root)
    return [PlannedCubin(module, arch, cubin_file_name(module, source_key(module, arch))) for module in modules]


def stale_modules(arch: str, packaged: Path | None = None, root: Path | None = None) -> list[str]:
    """Modules of `arch` whose current source has no packaged cubin (edited since the build,
    or never built); empty when the package is up to date."""
    folder = (packaged or packaged_root()) / arch
    return [plan.module.name for plan in planned_cubins(arch, root) if not (folder / plan.file_name).is_file()]


def nvcc_command(nvcc: str, module: KernelModule, arch: str, output: Path) -> list[str] | None:
    """The nvcc command line that builds `module` as NVRTC would, or None when the module sets
    an option nvcc is not told here how to pass."""
    command = [nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-o", str(output)]
    command += [f"-I{folder}" for folder in module.include_dirs]
    command += [f"-D{name}={value}" for name, value in module.defines]
    for name, value in module.options:
        spell = _NVCC_OPTIONS.get(name)
        if spell is None:
            return None
        command += spell(value)
    return [*command, str(module.source_path)]


def cubin_kernels(cubin: bytes) -> set[str]:
    """The kernel (global function) names an ELF64 cubin defines, read from its symbol table
    without the CUDA toolkit. ValueError when `cubin` is not a little-endian ELF64 file."""
    if cubin[:6] != b"\x7fELF\x02\x01":
        raise ValueError("not a little-endian ELF64 cubin")
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count = struct.unpack_from("<HH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names: set[str] = set()
    for _, kind, _, _, offset, size, link, _, _, symbol_size in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, symbol_size):
            name_at, info = struct.unpack_from("<IB", cubin, at)
            if info == 0x12:  # STB_GLOBAL, STT_FUNC
                end = cubin.index(b"\0", strings + name_at)
                names.add(cubin[strings + name_at:end].decode())
    return names


def nvcc_cuda_version(nvcc: str) -> tuple[int, str]:
    """(the version as the driver API counts it, 13000 for 13.0; nvcc's own line)."""
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.(\d+), (V[\d.]+)", output)
    if found is None:
        raise RuntimeError(f"cannot read the CUDA version from `{nvcc} --version`:\n{output}")
    major, minor, full = int(found[1]), int(found[2]), found[3]
    return major * 1000 + minor * 10, f"nvcc {full.removeprefix('V')}"


def build(arches: list[str], nvcc: str, jobs: int, packaged: Path | None = None, root: Path | None = None) -> int:
    """Compile what is missing, prune what is stale, rewrite the manifest; returns an exit code."""
    packaged = packaged or packaged_root()
    root = root or kernels_root()
    cuda_version, built_with = nvcc_cuda_version(nvcc)
    manifest_path = packaged / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"arches": {}}
    failures = 0
    for arch in arches:
        folder = packaged / arch
        folder.mkdir(parents=True, exist_ok=True)
        previous = manifest["arches"].get(arch, {})
        if previous.get("cuda_version") not in (None, cuda_version):
            shutil.rmtree(folder)  # another toolkit built these: rebuild them all with this one
            folder.mkdir(parents=True)
        plans = planned_cubins(arch, root)
        wanted = {plan.file_name for plan in plans}
        for stale in sorted(folder.glob("*.cubin")):
            if stale.name not in wanted:
                print(f"{arch}: removing {stale.name} (no current source has it)")
                stale.unlink()
        todo = [plan for plan in plans if not (folder / plan.file_name).is_file()]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(lambda plan: _compile(nvcc, plan, folder), todo))
        failures += results.count(False)
        entries = {}
        for plan in plans:
            path = folder / plan.file_name
            if path.is_file():
                entries[plan.file_name] = {
                    "module": plan.module.name,
                    "source": plan.module.source_path.relative_to(root.parent).as_posix(),
                    "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                }
        manifest["arches"][arch] = {"cuda_version": cuda_version, "built_with": built_with, "cubins": entries}
        total = sum((folder / name).stat().st_size for name in entries)
        print(f"{arch}: {len(entries)} of {len(plans)} modules packaged, {total / 2**20:.1f} MiB ({built_with})")
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 1 if failures else 0


def _compile(nvcc: str, plan: PlannedCubin, folder: Path) -> bool:
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=plan.file_name, suffix=".tmp")
    os.close(handle)
    command = nvcc_command(nvcc, plan.module, plan.arch, Path(temporary))
    if command is None:
        os.unlink(temporary)
        print(f"{plan.arch}: {plan.module.name}: options {dict(plan.module.options)} have no nvcc spelling here; "
              f"left to NVRTC", file=sys.stderr)
        return True
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        os.unlink(temporary)
        print(f"{plan.arch}: {plan.module.name} ({plan.module.source_path}) failed:\n{result.stderr}", file=sys.stderr)
        return False
    os.chmod(temporary, 0o644)  # mkstemp's file is private; package data is not
    os.replace(temporary, folder / plan.file_name)
    print(f"{plan.arch}: {plan.module.name} ({plan.module.folder}) in {time.perf_counter() - started:.1f} s")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlas.adapters.cuda.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", action="append", help=f"compile arch (repeatable; default {', '.join(DEFAULT_ARCHES)})")
    parser.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"), help="the nvcc to run (default: $NVCC or nvcc)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="modules compiled at once")
    parser.add_argument("--check", action="store_true", help="only list modules without an up-to-date cubin")
    args = parser.parse_args(argv)
    arches = args.arch or list(DEFAULT_ARCHES)
    if args.check:
        stale = {arch: stale_modules(arch) for arch in arches}
        for arch, names in stale.items():
            print(f"{arch}: {'stale or missing: ' + ', '.join(names) if names else 'up to date'}")
        return 1 if any(stale.values()) else 0
    if shutil.which(args.nvcc) is None:
        print(f"--nvcc: {args.nvcc} is not on PATH; install the CUDA toolkit or pass --nvcc", file=sys.stderr)
        return 2
    return build(arches, args.nvcc, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
