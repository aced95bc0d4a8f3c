"""Spawning the engine process, early when `atlas serve` can: before the API process's own imports.

The engine process needs its settings only once it has imported what loading a model takes
(the builder, and with `preload_cuda` the CUDA libraries: about a second each on a GPU
machine), so `atlas serve` spawns it first (`spawn_early`) and the API's `EngineProcess` takes
that process (`take_early`) when it would spawn one; both processes import side by side. An
early process nobody takes ends at `discard_early` (EOF on its socket). This module imports
only the standard library, so spawning costs the API process nothing it would not pay anyway.

In the engine process the CUDA libraries' own import and the driver's initialisation (cuInit)
run on a thread (`start_cuda_preload`) beside the builder's import: the settings are of no use
before both are done (loading needs the builder, the device needs the libraries), so what
shortens the wait for them is running the two side by side, not reading the settings sooner.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from atlas.app.threads import blas_thread_variables
from atlas.ports.startup import EPOCH_ENVIRONMENT, startup_epoch

PRELOAD_CUDA_FLAG = "--preload-cuda"
# The CUDA adapter's third-party imports (the `cuda` extra); nvmath's bindings come through
# `nvmath_bindings.load` (without the rest of nvmath). No `atlas` module is imported on the
# thread: the caller's thread imports those meanwhile, and two threads importing disjoint
# modules never wait on each other's import locks (nor trip importlib's deadlock detection on
# a circular pair).
CUDA_LIBRARIES = ("cuda.bindings.driver", "cuda.bindings.nvrtc", "cuda.core")


@dataclass(frozen=True, slots=True)
class SpawnedEngine:
    """An engine process and the API's end of its socket (the process has the other)."""

    process: subprocess.Popen
    sock: socket.socket
    preload_cuda: bool = False


def spawn_engine(preload_cuda: bool = False) -> SpawnedEngine:
    """Start `python -m atlas.app.engine_process FD`; it waits for its `Start` frame."""
    parent, child = socket.socketpair()
    command = [sys.executable, "-m", "atlas.app.engine_process", str(child.fileno())]
    command += [PRELOAD_CUDA_FLAG] if preload_cuda else []
    environment = {**os.environ, **blas_thread_variables()}
    process = subprocess.Popen(command, pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=environment)
    child.close()
    return SpawnedEngine(process, parent, preload_cuda)


def start_cuda_preload(libraries: tuple[str, ...] = CUDA_LIBRARIES) -> threading.Thread:
    """Import `libraries` and initialise the CUDA driver on a daemon thread; join it before
    importing the CUDA backend. Never raises: a missing extra, driver or GPU just ends the
    thread early, and the backend's own import (or `cuda.available()`) then says what is wrong."""
    from atlas.adapters.cuda import nvmath_bindings  # standard library only; imported here, not on the thread

    thread = threading.Thread(target=_preload_cuda, args=(libraries, nvmath_bindings.load), name="atlas-cuda-preload",
                              daemon=True)
    thread.start()
    return thread


def _preload_cuda(libraries: tuple[str, ...], load_nvmath: Callable[[], object]) -> None:
    try:
        for name in libraries:
            importlib.import_module(name)
        load_nvmath()
        from cuda.bindings import driver

        driver.cuInit(0)  # ~0.1-0.3 s, outside the GIL: the builder's import runs meanwhile
    except Exception:  # noqa: BLE001 - best effort (see the docstring)
        return


_early: list[SpawnedEngine] = []  # at most one: the process `spawn_early` started, until taken


def spawn_early(preload_cuda: bool) -> None:
    """Spawn the engine process now for the `EngineProcess` this process will start; its
    startup phases count from this process's start, as `run_server`'s own do. A process
    spawned earlier with the same `preload_cuda` (by `atlas.app.launch`) is kept."""
    os.environ.setdefault(EPOCH_ENVIRONMENT, repr(startup_epoch()))
    if _early and _early[0].preload_cuda == preload_cuda and _early[0].process.poll() is None:
        return
    discard_early()
    _early.append(spawn_engine(preload_cuda))


def take_early() -> SpawnedEngine | None:
    """The early process, once (None when there is none or it has exited)."""
    spawned = _early.pop() if _early else None
    if spawned is not None and spawned.process.poll() is not None:
        spawned.sock.close()
        return None
    return spawned


def discard_early() -> None:
    """Close an early process's socket if nobody took it; the process exits on the EOF."""
    while _early:
        spawned = _early.pop()
        spawned.sock.close()
        spawned.process.wait()
