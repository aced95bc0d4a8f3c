"""CUDA graphs by stream capture: record the ops a step enqueues once, replay them each step.

The runner keeps every input of a step (token ids, positions, slot mapping, block tables,
sampling parameters) in persistent device buffers and refreshes them with small copies before
`replay`, which then costs one launch instead of one per kernel.
"""

from __future__ import annotations

from collections.abc import Callable

from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.runtime import CudaRuntime


class CudaGraph:
    """An instantiated graph bound to the runtime's stream."""

    def __init__(self, rt: CudaRuntime, graph: object, executable: object) -> None:
        self._rt = rt
        self._graph = graph
        self._executable = executable

    def replay(self) -> None:
        """Enqueue the captured work on the stream (asynchronous, like any op)."""
        self._rt.ensure_current()
        check("cuGraphLaunch", cu.cuGraphLaunch(self._executable, self._rt.stream_handle))

    def __del__(self) -> None:
        executable, graph = self._executable, self._graph
        self._executable = self._graph = None
        if executable is not None:
            cu.cuGraphExecDestroy(executable)
        if graph is not None:
            cu.cuGraphDestroy(graph)


def capture(rt: CudaRuntime, fn: Callable[[], None]) -> CudaGraph:
    """Run `fn` under stream capture and instantiate what it enqueued.

    If `fn` raises, capture is ended and the partial graph discarded before the error
    propagates. `empty`, uploads and downloads raise `CaptureError` inside; workspaces the ops
    need may be created during capture, so no eager warm-up is required.
    """
    rt.ensure_current()
    if rt.capturing:
        raise RuntimeError("capture: already capturing (captures do not nest)")
    # Relaxed: a workspace may be allocated while capturing (cuMemAlloc is not a stream
    # operation); the ops themselves never synchronise.
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    check("cuStreamBeginCapture", cu.cuStreamBeginCapture(rt.stream_handle, mode))
    rt.capturing = True
    try:
        fn()
    except BaseException:
        rt.capturing = False
        result, graph = cu.cuStreamEndCapture(rt.stream_handle)
        if result == cu.CUresult.CUDA_SUCCESS and graph is not None:
            cu.cuGraphDestroy(graph)
        raise
    rt.capturing = False
    graph = check("cuStreamEndCapture", cu.cuStreamEndCapture(rt.stream_handle))
    executable = check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))
    return CudaGraph(rt, graph, executable)
