"""Where models live: resolving a model spec to a local Hugging Face folder, offline.

A spec is tried, in order, as

    1. a path to a folder                      ./my-model, /data/llama, ~/models/x
    2. a name pulled into Atlas's cache        $ATLAS_HOME/models/<name>   (default ~/.cache/atlas)
    3. a Hugging Face repo id in the HF cache  org/name[@revision]
         <hub>/models--org--name/refs/<revision or main>  -> commit hash
         <hub>/models--org--name/snapshots/<commit>/      -> the folder
       with <hub> = $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub
    4. a bare repo name found under exactly one org in the HF cache

Nothing here touches the network: a model that is not on disk is a ModelNotFoundError that
lists every place looked at and how to get the model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MODEL_MARKER = "config.json"
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_PATH_PREFIXES = ("/", "./", "../", "~", ".\\")


class ModelNotFoundError(ValueError):
    """No folder matches the spec; the message lists the places searched and the fix."""


def atlas_home() -> Path:
    """Atlas's data folder: $ATLAS_HOME, default ~/.cache/atlas."""
    return Path(os.environ.get("ATLAS_HOME") or "~/.cache/atlas").expanduser()


def models_dir() -> Path:
    """Where `atlas pull` puts models: <atlas_home>/models."""
    return atlas_home() / "models"


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def is_model_folder(folder: Path) -> bool:
    """A folder with a readable config.json (a dangling HF-cache symlink does not count)."""
    return (folder / MODEL_MARKER).is_file()


def resolve_model(spec: str) -> Path:
    """The local folder for `spec` (see the module docstring for the order).

    Raises ModelNotFoundError listing every place looked at, and how to get the model
    (`atlas pull smollm2`, `huggingface-cli download org/name`, or pass a folder).
    """
    spec = spec.strip()
    if not spec:
        raise ModelNotFoundError("no model given; pass a model folder, a pulled name (e.g. smollm2) or an HF repo id")
    searched: list[str] = []
    candidate = Path(spec).expanduser()
    if spec.startswith(_PATH_PREFIXES) or candidate.exists():
        if is_model_folder(candidate):
            return candidate.resolve()
        reason = "has no config.json" if candidate.is_dir() else "does not exist"
        searched.append(f"{candidate} ({reason})")
        if spec.startswith(_PATH_PREFIXES):
            raise _not_found(spec, searched)
    if "/" not in spec and "@" not in spec:
        pulled = models_dir() / spec
        if is_model_folder(pulled):
            return pulled
        searched.append(f"{pulled} (Atlas's model cache)")
    hub = hf_hub_cache()
    repo_id, _, revision = spec.partition("@")
    if _REPO_ID.match(repo_id):
        snapshot = _hf_snapshot(hub, repo_id, revision or "main", searched)
        if snapshot is not None:
            return snapshot
    elif "/" not in repo_id:
        snapshot = _unique_repo_by_name(hub, repo_id, revision or "main", searched)
        if snapshot is not None:
            return snapshot
    raise _not_found(spec, searched)


def _hf_snapshot(hub: Path, repo_id: str, revision: str, searched: list[str]) -> Path | None:
    """snapshots/<commit> for `revision` (a ref name or a commit hash) of one cached repo.

    Without a refs file for the revision, a single complete snapshot is taken as the answer;
    several snapshots without a ref are ambiguous and are reported instead of guessed.
    """
    repo_dir = hub / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    ref_file = repo_dir / "refs" / revision
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
        folder = snapshots / commit
        if is_model_folder(folder):
            return folder
        searched.append(f"{folder} ({repo_id}@{revision} -> {commit[:12]}, incomplete: no config.json)")
        return None
    if (snapshots / revision).is_dir():
        if is_model_folder(snapshots / revision):
            return snapshots / revision
        searched.append(f"{snapshots / revision} (incomplete: no config.json)")
        return None
    complete = sorted(p for p in snapshots.iterdir() if is_model_folder(p)) if snapshots.is_dir() else []
    if len(complete) == 1 and revision == "main":
        return complete[0]
    detail = f"{len(complete)} snapshots and no refs/{revision}" if complete else "not in the Hugging Face cache"
    searched.append(f"{repo_dir} ({detail})")
    return None


def _unique_repo_by_name(hub: Path, name: str, revision: str, searched: list[str]) -> Path | None:
    matches = sorted(hub.glob(f"models--*--{name}")) if hub.is_dir() else []
    repo_ids = [m.name.removeprefix("models--").replace("--", "/", 1) for m in matches]
    if len(repo_ids) == 1:
        return _hf_snapshot(hub, repo_ids[0], revision, searched)
    if repo_ids:
        searched.append(f"{hub} (several repos named {name!r}: {', '.join(repo_ids)}; pass org/name)")
    else:
        searched.append(f"{hub}/models--*--{name} (Hugging Face cache)")
    return None


def _not_found(spec: str, searched: list[str]) -> ModelNotFoundError:
    places = "\n".join(f"  - {place}" for place in searched)
    return ModelNotFoundError(
        f"model {spec!r} not found. Looked in:\n{places}\n"
        "Fix: run `atlas pull smollm2` for the small default model, download a Hugging Face model "
        "(`huggingface-cli download org/name`), or pass the path of a model folder holding config.json."
    )


def list_pulled_models() -> list[str]:
    """Names of the complete models in Atlas's cache, sorted."""
    folder = models_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".") and is_model_folder(p))
