"""What shortens a server's start before any model loads: the engine process spawned by the
`atlas` entry before the CLI's imports, and nvmath's bindings without nvmath's `__init__`."""

from __future__ import annotations

import sys
import textwrap

import pytest

from atlas.adapters.cuda import nvmath_bindings
from atlas.app.launch import early_engine


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    (["serve", "smollm2"], {}, True),  # auto may be a GPU
    (["serve", "smollm2", "--device", "mock"], {}, False),
    (["serve", "smollm2", "--device=cuda"], {"ATLAS_DEVICE": "mock"}, True),
    (["serve", "smollm2"], {"ATLAS_DEVICE": "mock"}, False),
    (["-v", "serve", "smollm2", "--port", "9000"], {}, True),
    (["serve", "smollm2", "--single-process"], {}, None),
    (["serve", "smollm2"], {"ATLAS_SINGLE_PROCESS": "1"}, None),
    (["serve", "--help"], {}, None),
    (["generate", "smollm2", "--device", "cuda"], {}, None),
    (["bench", "serve", "--url", "http://x"], {}, None),
    ([], {}, None),
])
def test_the_entry_spawns_an_engine_process_only_for_serve_with_one(argv, environ, expected):
    assert early_engine(argv, environ) is expected


@pytest.fixture
def package_on_path(tmp_path, monkeypatch):
    root = tmp_path / "atlas_probe_pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text(textwrap.dedent("""
        version = "1.2"
        from atlas_probe_pkg import heavy  # what the real __init__ would pay for
    """))
    (root / "heavy.py").write_text("LOADED = True\n")
    (root / "sub" / "__init__.py").write_text("")
    (root / "sub" / "binding.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "atlas_probe_pkg"
    for name in [name for name in sys.modules if name.startswith("atlas_probe_pkg")]:
        del sys.modules[name]


def test_a_package_registered_uninitialised_imports_submodules_without_its_init(package_on_path):
    nvmath_bindings.register_uninitialised(package_on_path)
    from atlas_probe_pkg.sub import binding

    assert binding.VALUE == 42
    assert "atlas_probe_pkg.heavy" not in sys.modules  # the __init__ has not run


def test_the_init_runs_once_at_the_first_name_only_it_defines(package_on_path):
    nvmath_bindings.register_uninitialised(package_on_path)
    import atlas_probe_pkg
    from atlas_probe_pkg.sub import binding  # noqa: F401

    assert atlas_probe_pkg.version == "1.2"
    assert "atlas_probe_pkg.heavy" in sys.modules and atlas_probe_pkg.heavy.LOADED
    assert "__getattr__" not in vars(atlas_probe_pkg)
    with pytest.raises(AttributeError):
        atlas_probe_pkg.no_such_name  # noqa: B018


def test_an_imported_package_is_left_alone(package_on_path):
    import atlas_probe_pkg

    nvmath_bindings.register_uninitialised(package_on_path)
    assert sys.modules[package_on_path] is atlas_probe_pkg and atlas_probe_pkg.version == "1.2"


def test_a_missing_package_is_an_import_error():
    with pytest.raises(ImportError, match="not installed"):
        nvmath_bindings.register_uninitialised("atlas_no_such_package_anywhere")
