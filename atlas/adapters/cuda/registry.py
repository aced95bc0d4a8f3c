"""The kernel registry: which CUDA source implements each kernel module for a (GPU, model, quant).

Pure Python (no CUDA import), so the CLI and CPU tests can list and check the selection.

Sources live under `kernels/` at the repository root, shipped in the wheel as `atlas.kernels`:

    kernels/
      common/                   generic kernels; every *.cu file is one module, named by its stem
        KERNELS.toml            optional: per-module compiler options and defines
        atlas_common.cuh        headers shared by every module (on every include path)
        gemv.cu  norm.cu ...
      sm90/llama/bf16/          tuned variants for Hopper x llama x bf16
        KERNELS.toml            the modules this folder provides (only listed ones count)
        gemv.cu

A tuned folder's path says what it is for, `<arch>/<model>/<quant>`, each part optional from the
right (`sm90/` serves every model on Hopper) and `any` matching everything. For each module
name the most specific folder that provides it wins: the arch counts 4, the model 2, the quant
1, so `sm90/` (4) beats `any/llama/bf16/` (3) and `sm90/llama/` (6) beats `sm90/` (4). A tuned
module must define every kernel symbol of the generic module it replaces.

KERNELS.toml of a tuned folder:

    [[kernel]]
    name = "gemv"                  # the module it provides (and the file gemv.cu by default)
    source = "gemv.cu"             # optional
    options = { max_register_count = 96 }  # optional, cuda.core ProgramOptions fields
    defines = { GEMV_WARPS = "8" } # optional, macros (launch bounds, tile sizes)
    note = "why this variant exists"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

WILDCARD = "any"
_PART_WEIGHTS = (4, 2, 1)  # arch, model, quant


class KernelRegistryError(ValueError):
    """A KERNELS.toml that cannot be read, or a listed source that does not exist."""


@dataclass(frozen=True, slots=True)
class KernelTarget:
    """What kernels are chosen for: the GPU's arch family (`sm90`), model type, quant."""

    arch: str
    model: str
    quant: str = "bf16"


@dataclass(frozen=True, slots=True)
class KernelModule:
    """One compilation unit: a .cu file and how to compile it."""

    name: str
    source_path: Path
    folder: str  # relative to the kernels root: "common" or "sm90/llama/bf16"
    options: tuple[tuple[str, object], ...] = ()  # cuda.core ProgramOptions fields
    defines: tuple[tuple[str, str], ...] = ()
    specificity: int = 0
    note: str = ""

    @property
    def include_dirs(self) -> tuple[Path, ...]:
        """The module's own folder, then `common/` for the shared headers."""
        own = self.source_path.parent
        common = _common_dir_of(own)
        return (own,) if own == common else (own, common)


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One row of `atlas kernels`: which source serves a module and why."""

    name: str
    source_path: str
    reason: str
    cached: bool | None  # None when the cache state is unknown (no compiler to key it)


def kernels_root() -> Path:
    """The folder holding `common/` and the tuned folders: `atlas/kernels` in a wheel, the
    repository's `kernels/` in a checkout. Raises `KernelRegistryError` when neither exists."""
    import atlas

    package_dir = Path(atlas.__file__).resolve().parent
    for candidate in (package_dir / "kernels", package_dir.parent / "kernels"):
        if (candidate / "common").is_dir():
            return candidate
    raise KernelRegistryError(f"no kernels/common folder next to {package_dir} (a broken install?)")


def select_modules(target: KernelTarget, root: Path | None = None) -> dict[str, KernelModule]:
    """The winning module for every name, most specific folder first (see the module doc).

    Raises `KernelRegistryError` for a malformed KERNELS.toml or a listed file that is missing.
    """
    root = root or kernels_root()
    chosen = {module.name: module for module in _common_modules(root)}
    for folder, parts in _tuned_folders(root):
        score = _specificity(parts, target)
        if score is None:
            continue
        for module in _listed_modules(root, folder, score):
            current = chosen.get(module.name)
            if current is None or module.specificity > current.specificity:
                chosen[module.name] = module
    return dict(sorted(chosen.items()))


def selectable_modules(arch: str, root: Path | None = None) -> list[KernelModule]:
    """Every module that some target on arch family `arch` (`sm90`) selects: the generic ones
    no tuned folder of this arch replaces for every model and quant, and the tuned folders'
    (what `python -m atlas.adapters.cuda.prebuild` compiles)."""
    root = root or kernels_root()
    models, quants = {WILDCARD}, {"bf16"}
    for _, parts in _tuned_folders(root):
        if len(parts) > 1 and parts[1] != WILDCARD:
            models.add(parts[1])
        if len(parts) > 2 and parts[2] != WILDCARD:
            quants.add(parts[2])
    chosen: dict[tuple[str, Path], KernelModule] = {}
    for model in sorted(models):
        for quant in sorted(quants):
            for module in select_modules(KernelTarget(arch, model, quant), root).values():
                chosen[(module.name, module.source_path)] = module
    return sorted(chosen.values(), key=lambda module: (module.name, module.folder))


def describe(module: KernelModule) -> str:
    """Why a module was chosen, for logs and `atlas kernels`."""
    if module.folder == "common":
        return "generic (kernels/common)"
    note = f": {module.note}" if module.note else ""
    return f"tuned for {module.folder} (specificity {module.specificity}){note}"


def arch_family(compute_capability: tuple[int, int]) -> str:
    """`sm90` for (9, 0): the name tuned folders use."""
    major, minor = compute_capability
    return f"sm{major}{minor}"


def family_of_arch(arch: str) -> str:
    """`sm90` for the compile arch `sm_90a` (or `sm_90`); ValueError for anything else."""
    digits = arch.removeprefix("sm_").removesuffix("a")
    if not arch.startswith("sm_") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"{arch!r} is not a compile arch like sm_90a")
    return f"sm{digits}"


def nvrtc_arch(compute_capability: tuple[int, int]) -> str:
    """The NVRTC `-arch` for a device: the `a` variant on Hopper and Blackwell (wgmma, tcgen05)."""
    major, minor = compute_capability
    suffix = "a" if major in (9, 10) else ""
    return f"sm_{major}{minor}{suffix}"


# -- discovery -------------------------------------------------------------------------------


def _common_dir_of(folder: Path) -> Path:
    for parent in (folder, *folder.parents):
        if (parent / "common").is_dir() and parent.name != "common":
            return parent / "common"
    return folder


def _common_modules(root: Path) -> list[KernelModule]:
    common = root / "common"
    settings = _read_toml(common / "KERNELS.toml") if (common / "KERNELS.toml").exists() else {}
    per_module = {entry["name"]: entry for entry in settings.get("kernel", []) if "name" in entry}
    modules = []
    for source in sorted(common.glob("*.cu")):
        entry = per_module.get(source.stem, {})
        modules.append(_module_from(entry, source.stem, source, "common", 0))
    return modules


def _tuned_folders(root: Path) -> list[tuple[Path, tuple[str, ...]]]:
    folders = []
    for manifest in sorted(root.rglob("KERNELS.toml")):
        folder = manifest.parent
        relative = folder.relative_to(root).parts
        if relative and relative[0] != "common" and len(relative) <= 3:
            folders.append((folder, relative))
    return folders


def _specificity(parts: tuple[str, ...], target: KernelTarget) -> int | None:
    """The folder's score for `target`, or None when a named part does not match."""
    score = 0
    for part, wanted, weight in zip(parts, (target.arch, target.model, target.quant), _PART_WEIGHTS):
        if part == WILDCARD:
            continue
        if part != wanted:
            return None
        score += weight
    return score


def _listed_modules(root: Path, folder: Path, score: int) -> list[KernelModule]:
    manifest = folder / "KERNELS.toml"
    entries = _read_toml(manifest).get("kernel", [])
    modules = []
    for entry in entries:
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise KernelRegistryError(f"{manifest}: every [[kernel]] needs a name")
        source = folder / entry.get("source", f"{name}.cu")
        if not source.is_file():
            raise KernelRegistryError(f"{manifest}: kernel {name!r} lists {source.name}, which does not exist")
        modules.append(_module_from(entry, name, source, folder.relative_to(root).as_posix(), score))
    return modules


def _module_from(entry: dict, name: str, source: Path, folder: str, score: int) -> KernelModule:
    options = entry.get("options", {})
    defines = entry.get("defines", {})
    if not isinstance(options, dict):
        raise KernelRegistryError(f"{source.parent / 'KERNELS.toml'}: options of {name!r} must be a table")
    if not isinstance(defines, dict):
        raise KernelRegistryError(f"{source.parent / 'KERNELS.toml'}: defines of {name!r} must be a table")
    return KernelModule(
        name=name,
        source_path=source,
        folder=folder,
        options=tuple(sorted(options.items())),
        defines=tuple(sorted((str(k), str(v)) for k, v in defines.items())),
        specificity=score,
        note=str(entry.get("note", "")),
    )


def _read_toml(path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise KernelRegistryError(f"{path}: {error}") from error
