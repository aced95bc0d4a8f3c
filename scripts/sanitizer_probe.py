"""Proof that compute-sanitizer sees our NVRTC-loaded kernels: a planted out-of-bounds write.

Run under `compute-sanitizer --tool memcheck`; its ERROR SUMMARY must count errors. The op
suite's clean summary means something only if this one is not clean.
"""

from __future__ import annotations

import numpy as np

from atlas.adapters.cuda import CudaGpuBackend
from atlas.ports.gpu import DType

backend = CudaGpuBackend()
tensor = backend.empty((64,), DType.I64)  # 512 bytes
# fill_u64 told the tensor has 2**24 elements: writes far past the allocation.
backend.runtime.launch("elementwise", "fill_u64", (64,), 256, tensor.address, np.int64(1 << 24), np.uint64(7))
try:
    backend.synchronize()
except Exception as error:  # the planted fault may poison the context; the summary is what counts
    print(f"synchronize after the planted write: {error}")
