"""nvmath-python's cuBLAS and cuBLASLt bindings, without the rest of nvmath at import.

`import nvmath.bindings.cublasLt` first runs `nvmath/__init__.py`, which imports nvmath's
linalg, sparse, fft and tensor APIs: 0.56 s of the 0.63 s the import took in the engine
process's start on a 16-core H100 host (`python -X importtime`; the bindings alone 0.08 s),
and that start is on the path to a server's first token. Atlas calls only the two binding
modules, so `load()` registers the `nvmath` package without running its `__init__` when
nothing has imported it yet, then imports the bindings. The package stays whole for anyone
else: its path is intact (any `import nvmath.x` works), and the first look-up of a name only
its `__init__` defines (`nvmath.__version__`, `nvmath.linalg` before its import) runs that
`__init__` then (PEP 562's module `__getattr__`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
from types import ModuleType

_lock = threading.Lock()


def load() -> tuple[ModuleType, ModuleType]:
    """(`nvmath.bindings.cublas`, `nvmath.bindings.cublasLt`); ImportError without nvmath."""
    register_uninitialised("nvmath")
    from nvmath.bindings import cublas, cublasLt

    return cublas, cublasLt


def register_uninitialised(name: str) -> None:
    """Register the top-level package `name` in `sys.modules` without running its `__init__`
    until a name only that code defines is looked up; nothing when it is imported already.
    ImportError when it is not installed."""
    with _lock:
        if name in sys.modules:
            return
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError(f"{name} is not installed as a package")
        _register(name, spec)


def _register(name: str, spec: importlib.machinery.ModuleSpec) -> None:
    package = importlib.util.module_from_spec(spec)  # __path__, __spec__ and the rest; no code run
    completed = threading.Lock()

    def complete(attribute: str) -> object:
        with completed:
            if package.__dict__.pop("__getattr__", None) is not None:
                spec.loader.exec_module(package)  # the real __init__; imported submodules are reused
        return getattr(package, attribute)

    package.__getattr__ = complete  # type: ignore[attr-defined]
    sys.modules[name] = package
