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


def test_a_shared_header_edit_makes_the_cubins_that_include_it_stale(tmp_path, fake_nvrtc):
    root = _kernels(tmp_path / "kernels")
    modules = select_modules(KernelTarget("sm90", "llama"), root)
    packaged = _package(tmp_path / "cubins", modules.values())
    (root / "common/atlas_common.cuh").write_text("#define ATLAS 2\n")
    compiler = KernelCompiler(ARCH, tmp_path / "cache", packaged)
    for module in select_modules(KernelTarget("sm90", "llama"), root).values():
        compiler.cubin(module)
    assert sorted(fake_nvrtc) == ["norm"]  # sm90's attention includes nothing: still packaged


@pytest.fixture(autouse=True)
def packaged_cubins_default(monkeypatch):
    """The package's cubins are on unless ATLAS_PACKAGED_CUBINS turns them off."""
    monkeypatch.delenv("ATLAS_PACKAGED_CUBINS", raising=False)


def test_packaged_cubins_are_on_unless_turned_off(tmp_path, monkeypatch):
    modules = select_modules(KernelTarget("sm90", "llama"), _kernels(tmp_path / "kernels"))
    _package(tmp_path / "cubins", modules.values(), cuda_version=13000)
    assert packaged_cubins(ARCH, 13000, tmp_path / "cubins") is not None
    for off in ("0", "off", "false"):
        monkeypatch.setenv("ATLAS_PACKAGED_CUBINS", off)
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


def _attention_tables() -> dict[str, object]:
    """ops_attention's literal kernel tables, read from its source (importing it needs the cuda
    extra)."""
    import ast

    from atlas.adapters.cuda import registry

    source = Path(registry.__file__).with_name("ops_attention.py").read_text()
    wanted = {"SUPPORTED_HEAD_DIMS", "DECODE_MMA_SHAPES", "DECODE_MMA_SHAPES_FP8", "_PREFILL_VARIANTS",
              "WGMMA_KEYS_PER_TILE", "WGMMA_X_MODULE"}
    tables = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", "") in wanted:
            tables[node.targets[0].id] = ast.literal_eval(node.value)
    assert set(tables) == wanted, f"ops_attention.py no longer defines {sorted(wanted - set(tables))} as literals"
    return tables


def _attention_symbols(arch: str) -> dict[str, set[str]]:
    """Every attention kernel ops_attention can ask for on `arch`, by module."""
    ops = _attention_tables()
    decode = {f"attention_decode_d{d}_h{h}" for d in ops["SUPPORTED_HEAD_DIMS"] for h in (1, 2, 4, 8)}
    for table, suffix in ((ops["DECODE_MMA_SHAPES"], ""), (ops["DECODE_MMA_SHAPES_FP8"], "_fp8")):
        for head_dim, shapes in table.items():
            for warps, stages in shapes:
                name = f"attention_decode_mma_d{head_dim}_w{warps}_s{stages}{suffix}"
                decode |= {name, name + "_x", name + "_cascade", name + "_x_cascade"}
    # the cascade's prefix kernels (shared prefixes), each cache dtype, with and without the extras
    decode |= {f"attention_cascade_d{d}{fp8}{x}" for d in ops["SUPPORTED_HEAD_DIMS"] for fp8 in ("", "_fp8")
               for x in ("", "_x")}
    twins = [f"{fp8}{x}" for fp8 in ("", "_fp8") for x in ("", "_x")]
    prefill = {f"attention_prefill_d{d}_m{rows}{twin}" for d, rows in ops["_PREFILL_VARIANTS"] for twin in twins}
    wanted = {"attention_decode": decode, "attention_prefill": set(prefill)}
    if arch == "sm_90a":  # kernels/sm90's bf16 wgmma kernels; head dim 256 and the _x twins in their own
        # module. (prefill_kernel asks `provides` first and falls back to mma.sync, as it does for the
        # FP8 twins that only some head dims have.)
        extras = wanted[ops["WGMMA_X_MODULE"]] = set(prefill)
        for head_dim, keys in ops["WGMMA_KEYS_PER_TILE"].items():
            name = f"attention_prefill_wgmma_d{head_dim}_n{keys}"
            (extras if head_dim == 256 else wanted["attention_prefill"]).add(name)
            extras.add(name + "_x")
    return wanted


@pytest.mark.parametrize("arch", prebuild.DEFAULT_ARCHES)
def test_the_shipped_cubins_define_every_attention_kernel_the_ops_launch(arch):
    """A packaged cubin lacking a variant the host picks by shape (a head dim, a decode shape,
    an FP8 or `_x` twin) would fail only on the model that picks it; the symbol tables say."""
    folder = packaged_root() / arch
    for module, symbols in _attention_symbols(arch).items():
        cubins = sorted(folder.glob(f"{module}-*.cubin"))
        assert len(cubins) == 1, f"{arch}: expected one packaged {module} cubin, found {cubins}"
        missing = symbols - prebuild.cubin_kernels(cubins[0].read_bytes())
        assert not missing, f"{arch}/{cubins[0].name} lacks {sorted(missing)}"


def test_cubin_kernels_reads_the_global_functions_and_refuses_other_files():
    cubin = next((packaged_root() / "sm_90a").glob("attention_decode-*.cubin")).read_bytes()
    names = prebuild.cubin_kernels(cubin)
    assert "attention_decode_mma_d128_w8_s2" in names and "attention_decode_d64_h1" in names
    assert not any(name.startswith("_Z") for name in names)  # device helpers and statics are not kernels
    with pytest.raises(ValueError, match="ELF64"):
        prebuild.cubin_kernels(b"not a cubin")


def test_the_source_key_follows_the_headers_a_module_includes_and_no_others(tmp_path):
    root = _kernels(tmp_path / "kernels")
    (root / "common/atlas_common.cuh").write_text('#include "helpers.cuh"\n#define ATLAS 1\n')
    (root / "common/helpers.cuh").write_text("#define HELP 1\n")
    (root / "common/unused.cuh").write_text("#define UNUSED 1\n")
    modules = select_modules(KernelTarget("sm90", "llama"), root)
    norm, attention = modules["norm"], modules["attention"]
    before = source_key(norm, ARCH), source_key(attention, ARCH)

    (root / "common/unused.cuh").write_text("#define UNUSED 2\n")  # nobody includes it
    assert (source_key(norm, ARCH), source_key(attention, ARCH)) == before

    (root / "common/helpers.cuh").write_text("#define HELP 2\n")  # norm reaches it through atlas_common
    assert source_key(norm, ARCH) != before[0]
    assert source_key(attention, ARCH) == before[1]  # includes nothing
