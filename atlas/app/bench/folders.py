"""Writing a model folder so that a half-written one never sits where a model is expected."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def staged_folder(out_dir: Path) -> Iterator[Path]:
    """Yield an empty folder beside `out_dir`; when the block succeeds it replaces `out_dir`
    (an existing folder there is removed first), when it fails it is deleted."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a model folder is an ordinary one
        yield staging
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
