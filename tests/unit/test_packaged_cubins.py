"""Packaged cubins: found by the module's current source, never stale, NVRTC the fallback.

No GPU and no NVRTC: the compiler's NVRTC calls are replaced by fakes that record being called,
and the prebuild runs a fake nvcc (a shell script), so these tests run everywhere."""

from __future__ import annotations

import hashlib
import json
import stat
import warnings
from pathlib import Path

import pytest

from atlas.adapters.cuda import compiler as compiler_module
from atlas.adapters.cuda import prebuild
from atlas.adapters.cuda.compiler import (
    MANIFEST_NAME,
    KernelCompiler,
    PackagedCubins,
    packaged_cubins,
    packaged_root,
    source_key,
)
from atlas.adapters.cuda.registry import KernelTarget, family_of_arch, select_modules, selectable_modules

ARCH = "sm_90a"


def _kernels(root: Path) -> Path:
    files = {
        "common/atlas_common.cuh": "#define ATLAS 1\n",
        "common/norm.cu": '#include "atlas_common.cuh"\nextern "C" __global__ void norm() {}\n',
        "common/attention.cu": 'extern "C" __global__ void attention() {}\n',
        "sm90/KERNELS.toml": '[[kernel]]\nname = "attention"\n',
        "sm90/attention.cu": 'extern "C" __global__ void attention() { /* wgmma */ }\n',
    }
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


def _package(folder: Path, modules, cuda_version: int = 13000) -> PackagedCubins:
    """A packaged folder holding a fake cubin (its module's name) for each of `modules`."""
    (folder / ARCH).mkdir(parents=True, exist_ok=True)
    for module in modules:
        (folder / ARCH / f"{module.name}-{source_key(module, ARCH)[:20]}.cubin").write_bytes(
            f"packaged {module.name}".encode()
        )
    (folder / MANIFEST_NAME).write_text(json.dumps({"arches": {ARCH: {"cuda_version": cuda_version}}}))
    packaged = packaged_cubins(ARCH, 13000, folder)
    assert packaged is not None
    return packaged


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """NVRTC replaced: a fixed version, and compiles recorded (their cubin names the module)."""
    compiled: list[str] = []

    def compile_module(self, module):
        compiled.append(module.name)
        return f"nvrtc {module.name}".encode()

    monkeypatch.setattr(compiler_module, "nvrtc_version", lambda: (13, 0))
    monkeypatch.setattr(KernelCompiler, "_compile", compile_module)
    return compiled


def test_a_packaged_cubin_is_used_without_nvrtc(tmp_path, fake_nvrtc, monkeypatch):
    monkeypatch.setattr(compiler_module, "nvrtc_version", lambda: pytest.fail("NVRTC was loaded"))
    modules = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))
    compiler = KernelCompiler(ARCH, tmp_path / "cache", _package(tmp_path / "cubins", modules.values()))
    assert compiler.cubin(modules["norm"]) == b"packaged norm"
    assert compiler.cubin(modules["attention"]) == b"packaged attention"
    assert compiler.stats.packaged == ["norm", "attention"] and fake_nvrtc == []
    assert compiler.is_cached(modules["norm"])


def test_an_edited_source_never_loads_its_stale_cubin(tmp_path, fake_nvrtc):
    root = _kernels(tmp_path / "kernels")
    modules = select_modules(KernelTarget("sm90", "llama"), root)
    packaged = _package(tmp_path / "cubins", modules.values())
    (root / "common/norm.cu").write_text('extern "C" __global__ void norm() { /* edited */ }\n')
    edited = select_modules(KernelTarget("sm90", "llama"), root)
    compiler = KernelCompiler(ARCH, tmp_path / "cache", packaged)
    assert not compiler.is_cached(edited["norm"])
    assert compiler.cubin(edited["norm"]) == b"nvrtc norm"
    assert fake_nvrtc == ["norm"] and compiler.stats.compiled == ["norm"]
    # the NVRTC cubin went to the disk cache: the next start reads it, still not the stale one
    again = KernelCompiler(ARCH, tmp_path / "cache", packaged)
    assert again.cubin(edited["norm"]) == b"nvrtc norm" and again.stats.loaded_from_cache == ["norm"]


def test_a_shared_header_edit_makes_every_including_cubin_stale(tmp_path, fake_nvrtc):
    root = _kernels(tmp_path / "kernels")
    modules = select_modules(KernelTarget("sm90", "llama"), root)
    packaged = _package(tmp_path / "cubins", modules.values())
    (root / "common/atlas_common.cuh").write_text("#define ATLAS 2\n")
    compiler = KernelCompiler(ARCH, tmp_path / "cache", packaged)
    for module in select_modules(KernelTarget("sm90", "llama"), root).values():
        compiler.cubin(module)
    assert sorted(fake_nvrtc) == ["attention", "norm"]


@pytest.fixture(autouse=True)
def packaged_cubins_on(monkeypatch):
    """The package's cubins are opt-in (ATLAS_PACKAGED_CUBINS=1); these tests ask for them."""
    monkeypatch.setenv("ATLAS_PACKAGED_CUBINS", "1")


def test_packaged_cubins_are_off_unless_asked_for(tmp_path, monkeypatch):
    modules = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))
    _package(tmp_path / "cubins", modules.values(), cuda_version=13000)
    monkeypatch.delenv("ATLAS_PACKAGED_CUBINS")
    assert packaged_cubins(ARCH, 13000, tmp_path / "cubins") is None


def test_a_module_named_in_the_skip_list_goes_to_nvrtc(tmp_path, monkeypatch, fake_nvrtc):
    root = _kernels(tmp_path / "kernels")
    modules = select_modules(KernelTarget("sm90", "llama"), root)
    packaged = _package(tmp_path / "cubins", modules.values())
    monkeypatch.setenv("ATLAS_PACKAGED_CUBINS_SKIP", "norm")
    compiler = KernelCompiler(ARCH, tmp_path / "cache", packaged)
    for module in modules.values():
        compiler.cubin(module)
    assert sorted(fake_nvrtc) == ["norm"]


def test_packaged_cubins_are_skipped_when_turned_off_or_the_driver_is_older(tmp_path, monkeypatch):
    modules = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))
    _package(tmp_path / "cubins", modules.values(), cuda_version=13000)
    assert packaged_cubins(ARCH, 12080, tmp_path / "cubins") is None
    assert packaged_cubins(ARCH, None, tmp_path / "cubins") is not None  # not checked: describing only
    assert packaged_cubins("sm_100a", 13000, tmp_path / "cubins") is None  # none built for that arch
    monkeypatch.setenv("ATLAS_PACKAGED_CUBINS", "0")
    assert packaged_cubins(ARCH, 13000, tmp_path / "cubins") is None


def test_the_nvrtc_cache_key_adds_the_nvrtc_version_to_the_source_key(tmp_path, monkeypatch):
    module = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))["norm"]
    keys = []
    for version in ((13, 0), (13, 1)):
        monkeypatch.setattr(compiler_module, "nvrtc_version", lambda version=version: version)
        keys.append(KernelCompiler(ARCH, tmp_path).cache_key(module))
    assert keys[0] != keys[1]
    assert source_key(module, ARCH) != source_key(module, "sm_100a")


def test_selectable_modules_leave_out_a_generic_module_every_target_replaces(tmp_path):
    root = _kernels(tmp_path / "kernels")
    on_hopper = {(m.name, m.folder) for m in selectable_modules("sm90", root)}
    assert on_hopper == {("norm", "common"), ("attention", "sm90")}
    on_blackwell = {(m.name, m.folder) for m in selectable_modules("sm100", root)}
    assert on_blackwell == {("norm", "common"), ("attention", "common")}
    assert family_of_arch("sm_100a") == "sm100"
    with pytest.raises(ValueError, match="compile arch"):
        family_of_arch("compute_90")


def _fake_nvcc(folder: Path) -> Path:
    """An nvcc that prints a version and writes its arguments' source path as the cubin."""
    script = folder / "nvcc"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "Cuda compilation tools, release 13.0, V13.0.88"; exit 0; fi\n'
        'out=""; prev=""; last=""\n'
        'for a in "$@"; do [ "$prev" = -o ] && out=$a; prev=$a; last=$a; done\n'
        'echo "cubin of $last" > "$out"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_prebuild_compiles_what_is_missing_prunes_what_is_stale_and_writes_the_manifest(tmp_path, capsys):
    root = _kernels(tmp_path / "kernels")
    nvcc = str(_fake_nvcc(tmp_path))
    packaged = tmp_path / "cubins"
    (packaged / ARCH).mkdir(parents=True)
    (packaged / ARCH / "norm-00000000000000000000.cubin").write_bytes(b"old")
    assert prebuild.build([ARCH], nvcc, 2, packaged, root) == 0
    names = sorted(path.name for path in (packaged / ARCH).glob("*.cubin"))
    assert names == sorted(plan.file_name for plan in prebuild.planned_cubins(ARCH, root))
    assert "norm-00000000000000000000.cubin" not in names
    manifest = json.loads((packaged / MANIFEST_NAME).read_text())["arches"][ARCH]
    assert manifest["cuda_version"] == 13000 and manifest["built_with"] == "nvcc 13.0.88"
    for name, entry in manifest["cubins"].items():
        assert entry["sha256"] == hashlib.sha256((packaged / ARCH / name).read_bytes()).hexdigest()
    assert prebuild.stale_modules(ARCH, packaged, root) == []
    (root / "sm90/attention.cu").write_text('extern "C" __global__ void attention() { /* v2 */ }\n')
    assert prebuild.stale_modules(ARCH, packaged, root) == ["attention"]


def test_nvcc_gets_the_options_nvrtc_would_and_refuses_one_it_cannot_spell(tmp_path):
    from dataclasses import replace

    module = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))["attention"]
    tuned = replace(module, defines=(("TILE", "64"),), options=(("max_register_count", 96),))
    command = prebuild.nvcc_command("nvcc", tuned, ARCH, tmp_path / "out.cubin")
    assert command[:4] == ["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17"]
    assert "-DTILE=64" in command and "--maxrregcount=96" in command
    assert f"-I{tmp_path / 'kernels/sm90'}" in command and f"-I{tmp_path / 'kernels/common'}" in command
    assert prebuild.nvcc_command("nvcc", replace(module, options=(("no_such_option", 1),)), ARCH, tmp_path) is None


def test_the_shipped_cubins_match_their_manifest_and_stale_ones_are_reported():
    """Integrity fails the test; a kernel edited without `python -m atlas.adapters.cuda.prebuild`
    only warns (its module compiles with NVRTC at startup, correct but slower)."""
    root = packaged_root()
    manifest = json.loads((root / MANIFEST_NAME).read_text())["arches"]
    assert set(manifest) >= {"sm_90a"}
    for arch, entry in manifest.items():
        files = {path.name for path in (root / arch).glob("*.cubin")}
        assert files == set(entry["cubins"]), f"{arch}: cubins and MANIFEST.json disagree; rerun the prebuild"
        for name, cubin in entry["cubins"].items():
            data = (root / arch / name).read_bytes()
            assert data[:4] == b"\x7fELF" and hashlib.sha256(data).hexdigest() == cubin["sha256"], name
        stale = prebuild.stale_modules(arch)
        if stale:
            warnings.warn(f"{arch}: packaged cubins are stale for {', '.join(stale)}: run "
                          f"`python -m atlas.adapters.cuda.prebuild` (NVRTC compiles them at startup meanwhile)",
                          stacklevel=1)
