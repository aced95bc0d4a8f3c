"""The `atlas` command's entry: `atlas serve` starts its engine process before the CLI's imports.

The engine process spends about 2 s importing the builder and the CUDA libraries before it can
load a model, and that wait is on the path to a server's first token. `atlas.app.cli` itself
imports numpy, msgspec and every command's flags (~0.6 s on a GPU host) before it can parse
`atlas serve`'s command line, so spawning the engine process from there started that wait late.
This module imports only the standard library and `engine_spawn`, reads just enough of the
command line to know that it is `atlas serve` with an engine process of its own (no
`--single-process`) and whether it may use CUDA (`--device`), spawns that process, then hands
over to `atlas.app.cli`, which parses the flags for real and takes the process (or, if this
reading guessed wrong, lets it exit on EOF and spawns its own).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from atlas.ports import startup as _startup  # noqa: F401 - first, so a server's start counts from here

_TRUE = ("1", "true", "yes", "on")


def main() -> int:
    preload_cuda = early_engine(sys.argv[1:], os.environ)
    if preload_cuda is not None:
        from atlas.app import engine_spawn

        engine_spawn.spawn_early(preload_cuda)
    from atlas.app.cli import main as cli_main

    return cli_main()


def early_engine(argv: Sequence[str], environ: Mapping[str, str]) -> bool | None:
    """For `atlas serve ...` run with an engine process, whether that process should preload
    CUDA (device cuda or auto, from `--device` or ATLAS_DEVICE); None for any other command,
    `--single-process` (or ATLAS_SINGLE_PROCESS), or a help request."""
    args = list(argv)
    while args and args[0] in ("-v", "--verbose"):
        args.pop(0)
    if not args or args[0] != "serve":
        return None
    flags = args[1:]
    if any(flag in ("-h", "--help", "--single-process") for flag in flags):
        return None
    if environ.get("ATLAS_SINGLE_PROCESS", "").lower() in _TRUE:
        return None
    device = environ.get("ATLAS_DEVICE", "auto")
    for index, flag in enumerate(flags):
        if flag == "--device" and index + 1 < len(flags):
            device = flags[index + 1]
        elif flag.startswith("--device="):
            device = flag.partition("=")[2]
    return device in ("cuda", "auto")


if __name__ == "__main__":
    sys.exit(main())
