"""`atlas generate`, `atlas chat` and `atlas.LLM` limit numpy's BLAS threads as `atlas serve`
does (every core but one), whether numpy loaded before or after, and never against the user's
own OPENBLAS_NUM_THREADS / OMP_NUM_THREADS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlas.app.bench.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
# The thread count of the OpenBLAS numpy loaded, read back through its own getter.
READ_THREADS = """
import ctypes
paths = sorted({line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower() and "/" in line})
library = ctypes.CDLL(paths[0])
getter = next(getattr(library, name) for name in ("scipy_openblas_get_num_threads64_",
              "scipy_openblas_get_num_threads", "openblas_get_num_threads64_", "openblas_get_num_threads")
              if hasattr(library, name))
print("threads", getter())
"""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def blas_threads_after(code: str, **env: str) -> int:
    environment = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    result = subprocess.run([sys.executable, "-c", code + READ_THREADS], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**environment, "PYTHONPATH": str(ROOT), **env})
    assert result.returncode == 0, result.stderr
    return int(result.stdout.split("threads")[-1])


EXPECTED = max(1, len(os.sched_getaffinity(0)) - 1)


def test_atlas_generate_leaves_one_core_free(tiny_model):
    code = ("from atlas.app.cli import main\n"
            f"assert main(['generate', {str(tiny_model)!r}, '--prompt', 'x', '--device', 'mock', '--max-tokens', '1'])"
            " == 0\n")
    assert blas_threads_after(code) == EXPECTED


def test_atlas_llm_limits_a_numpy_that_loaded_first(tiny_model):
    code = f"import numpy, atlas\natlas.LLM({str(tiny_model)!r}, device='mock', show_progress=False)\n"
    assert blas_threads_after(code) == EXPECTED


def test_the_users_own_setting_wins(tiny_model):
    code = f"import numpy, atlas\natlas.LLM({str(tiny_model)!r}, device='mock', show_progress=False)\n"
    assert blas_threads_after(code, OPENBLAS_NUM_THREADS="2") == 2
