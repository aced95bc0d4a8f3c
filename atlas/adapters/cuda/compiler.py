"""NVRTC compilation of kernel modules with an on-disk cubin cache.

A cubin is cached under a key that changes whenever anything that shapes it changes: the module
source, every header on its include path, the target arch, the NVRTC version and the options.
A warm start therefore compiles nothing; `CompileStats` says how many modules were compiled and
how many were loaded from the cache.

The cache folder is `$ATLAS_KERNEL_CACHE`, else `~/.cache/atlas/kernels`. Files are written to a
temporary name and renamed, so concurrent processes never read half a cubin.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from atlas.adapters.cuda.registry import KernelModule

log = logging.getLogger("atlas.cuda")

_LANGUAGE_STANDARD = "c++17"


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel module; the message names the file and carries the log."""


@dataclass(slots=True)
class CompileStats:
    compiled: list[str] = field(default_factory=list)
    loaded_from_cache: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, name: str, from_cache: bool) -> None:
        with self._lock:
            (self.loaded_from_cache if from_cache else self.compiled).append(name)


def default_cache_dir() -> Path:
    configured = os.environ.get("ATLAS_KERNEL_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "atlas" / "kernels"


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


class KernelCompiler:
    """Compiles kernel modules for one arch (`sm_90a`), through the disk cache."""

    def __init__(self, arch: str, cache_dir: Path | None = None) -> None:
        self.arch = arch
        self.cache_dir = cache_dir or default_cache_dir()
        self.stats = CompileStats()
        self._version = nvrtc_version()
        self._cuda_include = cuda_include_dir()

    def options_of(self, module: KernelModule) -> str:
        """Everything besides the sources that shapes the cubin, as one string for the key."""
        defines = " ".join(f"-D{name}={value}" for name, value in module.defines)
        options = " ".join(f"{name}={value!r}" for name, value in module.options)
        return f"std={_LANGUAGE_STANDARD} {defines} {options}"

    def cache_key(self, module: KernelModule) -> str:
        """Hex digest over source, headers, arch, NVRTC version and options."""
        digest = hashlib.sha256()
        digest.update(module.source_path.read_bytes())
        for include_dir in module.include_dirs:
            for header in sorted(include_dir.glob("*.cuh")):
                digest.update(header.name.encode())
                digest.update(header.read_bytes())
        digest.update(f"|{self.arch}|nvrtc {self._version}|{self.options_of(module)}".encode())
        return digest.hexdigest()

    def cache_path(self, module: KernelModule) -> Path:
        return self.cache_dir / f"{module.name}-{self.arch}-{self.cache_key(module)[:20]}.cubin"

    def is_cached(self, module: KernelModule) -> bool:
        return self.cache_path(module).is_file()

    def cubin(self, module: KernelModule) -> bytes:
        """The module's cubin: from the cache, or compiled now and stored.

        Raises `KernelCompileError` naming the module and its source with NVRTC's log.
        """
        path = self.cache_path(module)
        try:
            data = path.read_bytes()
        except OSError:
            data = b""
        if data:
            self.stats.record(module.name, from_cache=True)
            return data
        data = self._compile(module)
        self._store(path, data)
        self.stats.record(module.name, from_cache=False)
        return data

    def _compile(self, module: KernelModule) -> bytes:
        from cuda.core import Program, ProgramOptions

        include_path = [str(d) for d in module.include_dirs] + [str(self._cuda_include)]
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
