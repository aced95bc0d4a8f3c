"""Finding a process's descendants, for tests that check nothing is left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path


def descendants(root_pid: int) -> list[int]:
    """Every live process below `root_pid` (by parent links in /proc), zombies excluded."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [root_pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def rank_pids(root_pid: int | None = None) -> list[int]:
    """The rank processes (`python -m atlas.app.ranks`) below `root_pid` (default: this one)."""
    pids = []
    for pid in descendants(os.getpid() if root_pid is None else root_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"atlas.app.ranks" in command:
            pids.append(pid)
    return pids


def all_gone(pids: list[int], within_s: float = 15.0) -> bool:
    """Whether every pid has exited (a zombie counts) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.05)
    return False
