"""Read a page-cached file into a small pre-touched ring, as `UploadRing` fills its pinned slots:
through a fresh memory map (np.copyto, one fault per page not yet mapped) or with `os.preadv`
straight into the ring, on 1..N threads. Not a test: prints GB/s per way.

    python benchmarks/page_cache_reads.py [--gib 2] [--threads 1,2] [--chunk-mib 8]
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

RING_BYTES = 128 << 20


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(start + chunk, size)) for start in range(0, size, chunk)]


def _run(path: str, size: int, threads: int, chunk: int, way: str) -> float:
    ring = np.ones(RING_BYTES, dtype=np.uint8)  # touched: the pinned slots are resident
    slots = RING_BYTES // chunk
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if way.startswith("mmap") else None
    if way == "mmap+advise":
        mapped.madvise(mmap.MADV_SEQUENTIAL)
        mapped.madvise(mmap.MADV_WILLNEED)
    source = np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else None

    def copy(index: int, start: int, stop: int) -> None:
        slot = ring[(index % slots) * chunk :][: stop - start]
        if source is not None:
            np.copyto(slot, source[start:stop])
            return
        done = 0
        while done < stop - start:
            done += os.preadv(fd, [memoryview(slot[done:])], start + done)

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: copy(item[0], *item[1]), enumerate(_chunks(size, chunk))))
    seconds = time.perf_counter() - began
    del source
    if mapped is not None:
        mapped.close()
    os.close(fd)
    return size / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gib * (1 << 30))
    chunk = args.chunk_mib << 20
    with tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp"), suffix=".bin") as handle:
        block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes()
        for _ in range(0, size, len(block)):
            handle.write(block)
        handle.flush()
        size = os.path.getsize(handle.name)
        for threads in [int(value) for value in args.threads.split(",")]:
            for way in ("mmap", "mmap+advise", "preadv"):
                rates = [_run(handle.name, size, threads, chunk, way) for _ in range(args.repeats)]
                print(f"{way:12s} threads={threads} chunk={args.chunk_mib} MiB  "
                      + " ".join(f"{rate:5.2f}" for rate in rates) + " GB/s")


if __name__ == "__main__":
    main()
