"""How many threads numpy's BLAS may use where Atlas runs engine steps.

OpenBLAS starts a thread per core, and its idle threads spin. Next to Atlas's own busy thread
(the engine loop, the HTTP event loop) on a small or shared machine, they take turns on the
same cores: a 64x64 matmul measured 18 ms instead of 15 us on a loaded 2-core machine, and
`atlas generate` ran 8x slower. So every entry point that steps the engine in its process
leaves one core free: `atlas serve` (the engine process, or the API process with
--single-process), `atlas generate`, `atlas chat`, `atlas doctor`, `atlas bench` (so the mock's
figures are what those give) and `atlas.LLM`. A user's own OPENBLAS_NUM_THREADS or
OMP_NUM_THREADS always wins.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger("atlas")

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")
# The run-time setter of the OpenBLAS numpy wheels bundle (scipy-openblas), then plain OpenBLAS.
_SET_THREADS_SYMBOLS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                        "openblas_set_num_threads64_", "openblas_set_num_threads")


def blas_thread_variables() -> dict[str, str]:
    """The variables that give BLAS every core but one; empty when the user set one of them."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return {}
    return {"OPENBLAS_NUM_THREADS": str(_num_threads())}


def limit_blas_threads() -> None:
    """Apply `blas_thread_variables` to this process: through the environment before numpy
    loads (OpenBLAS reads it once, at load), through OpenBLAS's own setter after. Does nothing
    when the user chose; logs a warning when numpy's BLAS cannot be reached."""
    variables = blas_thread_variables()
    if not variables:
        return
    os.environ.update(variables)
    if "numpy" in sys.modules and not _set_loaded_openblas_threads(_num_threads()):
        log.warning("numpy was imported before Atlas could limit its BLAS threads; set %s yourself",
                    " and ".join(f"{k}={v}" for k, v in variables.items()))


def _num_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _set_loaded_openblas_threads(num_threads: int) -> bool:
    """Call the thread setter of the OpenBLAS already mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return False
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in _SET_THREADS_SYMBOLS:
            setter = getattr(library, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(num_threads))
                return True
    return False
