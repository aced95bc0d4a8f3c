"""What a checkpoint's load could reach on this host: page cache -> pinned -> device rates.

    python3 benchmarks/cuda/upload_rates.py ~/.cache/atlas/bench/llama-3.1-8b

Reads every .safetensors file of the folder (in the page cache: `cat` them first) in 8 MiB
chunks with `os.preadv` from 4, 8, 12 and 16 threads into page-locked memory (and once into
pageable memory), copies page-locked chunks to the device on one and two streams, and
registers a read-only map of the first file with `cuMemHostRegister` and copies from it. The
load's own rate is in `atlas serve`'s `startup: weights` line; these are its ceilings (an
H100/H200 host: reads 25-27 GB/s from 12-16 threads, DMA ~50 GB/s).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from cuda.bindings import driver as cu

CHUNK = 8 << 20
SLOTS = 64


def check(result):
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA error {error}")
    return values[0] if len(values) == 1 else values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a checkpoint folder of .safetensors files")
    args = parser.parse_args()
    files = sorted(glob.glob(os.path.join(args.folder, "*.safetensors")))
    if not files:
        raise SystemExit(f"no .safetensors files in {args.folder}")
    check(cu.cuInit(0))
    context = check(cu.cuDevicePrimaryCtxRetain(check(cu.cuDeviceGet(0))))
    check(cu.cuCtxSetCurrent(context))
    sizes = [os.path.getsize(path) for path in files]
    total = sum(sizes)
    chunks = [(path, offset, min(CHUNK, size - offset)) for path, size in zip(files, sizes)
              for offset in range(0, size, CHUNK)]
    descriptors = {path: os.open(path, os.O_RDONLY) for path in files}
    pinned = int(check(cu.cuMemHostAlloc(SLOTS * CHUNK, 0)))
    targets = {"page-locked": np.ctypeslib.as_array((ctypes.c_uint8 * (SLOTS * CHUNK)).from_address(pinned)),
               "pageable": np.empty(SLOTS * CHUNK, np.uint8)}

    def read(target: np.ndarray, index: int) -> int:
        path, offset, num_bytes = chunks[index]
        slot = index % SLOTS
        return os.preadv(descriptors[path], [memoryview(target[slot * CHUNK : slot * CHUNK + num_bytes])], offset)

    for name, threads in [("page-locked", 4), ("page-locked", 8), ("page-locked", 12), ("page-locked", 16),
                          ("pageable", 12)]:
        with ThreadPoolExecutor(threads) as pool:
            started = time.perf_counter()
            list(pool.map(lambda index: read(targets[name], index), range(len(chunks))))
            seconds = time.perf_counter() - started
        print(f"preadv into {name} memory, {threads:2d} threads: {total / seconds / 1e9:6.2f} GB/s")

    device_bytes = 4 << 30
    device = int(check(cu.cuMemAlloc(device_bytes)))
    streams = [check(cu.cuStreamCreate(1)) for _ in range(2)]
    for num_streams in (1, 2):
        started = time.perf_counter()
        for index in range(len(chunks)):
            check(cu.cuMemcpyHtoDAsync(device + (index * CHUNK) % device_bytes, pinned + (index % SLOTS) * CHUNK,
                                       CHUNK, streams[index % num_streams]))
        for stream in streams:
            check(cu.cuStreamSynchronize(stream))
        seconds = time.perf_counter() - started
        print(f"page-locked -> device, {num_streams} stream(s): {len(chunks) * CHUNK / seconds / 1e9:6.2f} GB/s")

    num_bytes = sizes[0] // mmap.PAGESIZE * mmap.PAGESIZE
    mapping = mmap.mmap(descriptors[files[0]], num_bytes, prot=mmap.PROT_READ)
    address = np.frombuffer(mapping, np.uint8).ctypes.data
    started = time.perf_counter()
    check(cu.cuMemHostRegister(address, num_bytes, cu.CU_MEMHOSTREGISTER_READ_ONLY))
    seconds = time.perf_counter() - started
    print(f"cuMemHostRegister of a {num_bytes / 1e9:.1f} GB read-only map: {seconds:.3f} s ({num_bytes / seconds / 1e9:.1f} GB/s)")
    copied = min(num_bytes, device_bytes)
    started = time.perf_counter()
    for offset in range(0, copied, 64 << 20):
        check(cu.cuMemcpyHtoDAsync(device + offset, address + offset, min(64 << 20, copied - offset), streams[0]))
    check(cu.cuStreamSynchronize(streams[0]))
    print(f"registered map -> device: {copied / (time.perf_counter() - started) / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
