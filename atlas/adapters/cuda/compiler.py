"""Kernel modules as cubins: shipped with the package, cached on disk, or compiled by NVRTC.

`KernelCompiler.cubin(module)` looks in three places, first hit wins:

1. Packaged cubins (`atlas/adapters/cuda/cubins/<arch>/`, built by
   `python -m atlas.adapters.cuda.prebuild`, through NVRTC by default), found by the module's
   *source key*: a digest of the module source, the headers it includes, the target arch and
   the options. A kernel source changed since the build gives another key, so a stale
   cubin is never loaded: the module falls through to the cache and NVRTC. The key leaves the
   compiler out; `cubins/MANIFEST.json` records the CUDA version that built them, and they are
   used only on a driver at least that new. On by default; `ATLAS_PACKAGED_CUBINS=0` turns them
   off and `ATLAS_PACKAGED_CUBINS_SKIP` names modules to leave to NVRTC, to bisect. (Cubins
   built by nvcc 13.0.88 trapped in decode attention on the 8B, an `LDGSTS` form NVRTC does not
   emit: docs/lab/packaged-cubins.md.)
2. The disk cache, under the *cache key*: the source key plus the NVRTC version.
3. NVRTC, whose cubin is then stored in the cache.

`CompileStats` says how many modules came from each. The cache folder is `$ATLAS_KERNEL_CACHE`,
else `~/.cache/atlas/kernels`. Files are written to a temporary name and renamed, so concurrent
processes never read half a cubin.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from atlas.adapters.cuda.registry import KernelModule

log = logging.getLogger("atlas.cuda")

_LANGUAGE_STANDARD = "c++17"
PACKAGED_ENVIRONMENT = "ATLAS_PACKAGED_CUBINS"
MANIFEST_NAME = "MANIFEST.json"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel module; the message names the file and carries the log."""


@dataclass(slots=True)
class CompileStats:
    """Which modules came from where: the package's cubins, the disk cache, or NVRTC."""

    compiled: list[str] = field(default_factory=list)
    loaded_from_cache: list[str] = field(default_factory=list)
    packaged: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, name: str, source: str) -> None:
        """`source`: "packaged", "cache" or "compiled"."""
        lists = {"packaged": self.packaged, "cache": self.loaded_from_cache, "compiled": self.compiled}
        with self._lock:
            lists[source].append(name)

    def describe(self) -> str:
        return f"{len(self.packaged)} packaged, {len(self.loaded_from_cache)} from cache, {len(self.compiled)} compiled"


def default_cache_dir() -> Path:
    configured = os.environ.get("ATLAS_KERNEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "atlas" / "kernels"


def packaged_root() -> Path:
    """Where the package's cubins live (`cubins/<arch>/`, beside this module)."""
    return Path(__file__).resolve().parent / "cubins"


@dataclass(frozen=True, slots=True)
class PackagedCubins:
    """The package's cubins for one arch: `folder` holds `<module>-<source key>.cubin` files,
    built by a CUDA toolkit whose version the driver must support (`required_cuda`,
    as cuDriverGetVersion reports it: 13000 for 13.0)."""

    folder: Path
    required_cuda: int

    def path_of(self, module: KernelModule, source_key: str) -> Path:
        return self.folder / cubin_file_name(module, source_key)


def cubin_file_name(module: KernelModule, source_key: str) -> str:
    return f"{module.name}-{source_key[:20]}.cubin"


def _skipped_modules() -> set[str]:
    """Modules `ATLAS_PACKAGED_CUBINS_SKIP` (comma-separated names) sends to NVRTC: to bisect a
    packaged cubin that misbehaves."""
    return {name.strip() for name in os.environ.get("ATLAS_PACKAGED_CUBINS_SKIP", "").split(",") if name.strip()}


def packaged_cubins(arch: str, driver_cuda: int | None, root: Path | None = None) -> PackagedCubins | None:
    """The package's cubins for `arch` when they can be used: not turned off
    (`ATLAS_PACKAGED_CUBINS=0`), built for this arch, and by a CUDA no newer than the driver's
    (`driver_cuda`, e.g. 12080 for 12.8; None: not checked, to describe them without a GPU).
    None otherwise (logged when the driver is too old)."""
    if os.environ.get(PACKAGED_ENVIRONMENT, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    root = root or packaged_root()
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        required = int(manifest["arches"][arch]["cuda_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if driver_cuda is not None and driver_cuda < required:
        log.info("packaged cubins for %s need a driver for CUDA %d.%d (this one: %d.%d); compiling with NVRTC",
                 arch, required // 1000, required % 1000 // 10, driver_cuda // 1000, driver_cuda % 1000 // 10)
        return None
    return PackagedCubins(root / arch, required)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-bindings loads."""
    from cuda.bindings import nvrtc

    result, major, minor = nvrtc.nvrtcVersion()
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelCompileError(f"nvrtcVersion failed: {result}")
    return int(major), int(minor)


def cuda_include_dir() -> Path:
    """Where cuda_bf16.h lives: cuda.pathfinder's answer, else $CUDA_HOME/include."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
        if found:
            return Path(found)
    except (ImportError, RuntimeError):
        pass
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_bf16.h").exists():
            return Path(home) / "include"
    raise KernelCompileError("cannot find the CUDA headers (cuda_bf16.h): install nvidia-cuda-runtime or set CUDA_HOME")


def options_of(module: KernelModule) -> str:
    """Everything besides the sources that shapes the cubin, as one string for the keys."""
    defines = " ".join(f"-D{name}={value}" for name, value in module.defines)
    options = " ".join(f"{name}={value!r}" for name, value in module.options)
    return f"std={_LANGUAGE_STANDARD} {defines} {options}"


_QUOTED_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def included_headers(module: KernelModule) -> list[Path]:
    """The headers that the module's source reaches through quoted `#include`s, transitively.
    Every file a name could resolve to is counted (the including file's folder, then the
    include path), and so is a name under `#if`: a superset of what the compiler reads, so no
    change to a header it reads leaves the key alone. Ordered by folder name, then file name."""
    found: set[Path] = set()
    pending = [module.source_path]
    while pending:
        current = pending.pop()
        for name in _QUOTED_INCLUDE.findall(current.read_bytes()):
            for folder in (current.parent, *module.include_dirs):
                candidate = (folder / name.decode()).resolve()
                if candidate.is_file() and candidate not in found:
                    found.add(candidate)
                    pending.append(candidate)
    return sorted(found, key=lambda header: (header.parent.name, header.name))


def source_key(module: KernelModule, arch: str) -> str:
    """Hex digest over the module source, the headers it includes (`included_headers`, each
    named by its folder and file name), the arch and the options: what any compiler turns into
    the cubin (the packaged cubins' key). A header edit changes the keys of the modules that
    include it, not every module's, so the prebuild rebuilds only their cubins."""
    digest = hashlib.sha256()
    digest.update(module.source_path.read_bytes())
    for header in included_headers(module):
        digest.update(f"{header.parent.name}/{header.name}".encode())
        digest.update(header.read_bytes())
    digest.update(f"|{arch}|{options_of(module)}".encode())
    return digest.hexdigest()


class KernelCompiler:
    """Cubins of kernel modules for one arch (`sm_90a`): packaged, cached, or compiled by NVRTC.

    `packaged`: the package's cubins to try first (`packaged_cubins`), or None. NVRTC is loaded
    only when a module must be compiled or its cache key computed.
    """

    def __init__(self, arch: str, cache_dir: Path | None = None, packaged: PackagedCubins | None = None) -> None:
        self.arch = arch
        self.cache_dir = cache_dir or default_cache_dir()
        self.packaged = packaged
        self.stats = CompileStats()
        self._version: tuple[int, int] | None = None
        self._cuda_include: Path | None = None
        self._lock = threading.Lock()

    def options_of(self, module: KernelModule) -> str:
        return options_of(module)

    def source_key(self, module: KernelModule) -> str:
        return source_key(module, self.arch)

    def cache_key(self, module: KernelModule) -> str:
        """Hex digest over the source key and the NVRTC version."""
        return hashlib.sha256(f"{self.source_key(module)}|nvrtc {self._nvrtc_version()}".encode()).hexdigest()

    def cache_path(self, module: KernelModule) -> Path:
        return self.cache_dir / f"{module.name}-{self.arch}-{self.cache_key(module)[:20]}.cubin"

    def packaged_path(self, module: KernelModule) -> Path | None:
        """The packaged cubin that matches the module's current source, if there is one."""
        if self.packaged is None or module.name in _skipped_modules():
            return None
        path = self.packaged.path_of(module, self.source_key(module))
        return path if path.is_file() else None

    def is_cached(self, module: KernelModule) -> bool:
        """Whether the module needs no compiling: packaged, or in the disk cache."""
        return self.packaged_path(module) is not None or self.cache_path(module).is_file()

    def cubin(self, module: KernelModule) -> bytes:
        """The module's cubin: packaged, from the cache, or compiled now and stored.

        Raises `KernelCompileError` naming the module and its source with NVRTC's log.
        """
        packaged = self.packaged_path(module)
        if packaged is not None:
            data = _read(packaged)
            if data:
                self.stats.record(module.name, "packaged")
                return data
        path = self.cache_path(module)
        data = _read(path)
        if data:
            self.stats.record(module.name, "cache")
            return data
        data = self._compile(module)
        self._store(path, data)
        self.stats.record(module.name, "compiled")
        return data

    def compile(self, module: KernelModule) -> bytes:
        """Compile the module with NVRTC now, bypassing the packaged cubins and the cache (the
        prebuild's path: packaged cubins are then the bytes this machine's NVRTC would make).
        Raises `KernelCompileError` as `cubin` does."""
        return self._compile(module)

    def _nvrtc_version(self) -> tuple[int, int]:
        with self._lock:
            if self._version is None:
                self._version = nvrtc_version()
            return self._version

    def _include_dir(self) -> Path:
        with self._lock:
            if self._cuda_include is None:
                self._cuda_include = cuda_include_dir()
            return self._cuda_include

    def _compile(self, module: KernelModule) -> bytes:
        from cuda.core import Program, ProgramOptions

        include_path = [str(d) for d in module.include_dirs] + [str(self._include_dir())]
        source = module.source_path.read_text()
        try:
            options = ProgramOptions(
                name=module.source_path.name,
                arch=self.arch,
                std=_LANGUAGE_STANDARD,
                include_path=include_path,
                define_macro=[(name, value) for name, value in module.defines] or None,
                **dict(module.options),
            )
        except TypeError as error:
            raise KernelCompileError(
                f"kernel module {module.name!r} ({module.source_path}): bad options {dict(module.options)}: {error}"
            ) from error
        try:
            program = Program(source, "c++", options)
            try:
                code = program.compile("cubin")
                return bytes(code.code)
            finally:
                program.close()
        except Exception as error:  # NVRTCError carries the compile log in its message
            raise KernelCompileError(
                f"kernel module {module.name!r} ({module.source_path}) failed to compile for {self.arch}:\n{error}"
            ) from error

    def _store(self, path: Path, data: bytes) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(temporary, path)
        except OSError as error:
            log.warning("kernel cache: cannot write %s (%s); the next start compiles again", path, error)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
