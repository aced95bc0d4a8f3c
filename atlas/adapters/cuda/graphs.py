"""CUDA graphs by stream capture: record the ops a step enqueues once, replay them each step.

The runner keeps every input of a step (token ids, positions, slot mapping, block tables,
sampling parameters) in persistent device buffers and refreshes them with small copies before
`replay`, which then costs one launch instead of one per kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuda.bindings import driver as cu

from atlas.adapters.cuda.driver import check
from atlas.adapters.cuda.runtime import CudaRuntime


class CudaGraph:
    """An instantiated graph bound to the runtime's stream; `early_launches` counts the kernels
    that launch once their predecessor has started (`launch_after_start`)."""

    def __init__(self, rt: CudaRuntime, graph: object, executable: object, early_launches: int = 0) -> None:
        self._rt = rt
        self._graph = graph
        self._executable = executable
        self.early_launches = early_launches

    def replay(self) -> None:
        """Enqueue the captured work on the stream (asynchronous, like any op)."""
        self._rt.ensure_current()
        check("cuGraphLaunch", cu.cuGraphLaunch(self._executable, self._rt.stream_handle))

    # The driver's functions bound here: a graph collected at interpreter exit (an engine never
    # closed) may outlive this module's globals, and must not print a traceback then.
    def __del__(self, _destroy_exec=cu.cuGraphExecDestroy, _destroy=cu.cuGraphDestroy) -> None:
        executable, graph = self._executable, self._graph
        self._executable = self._graph = None
        if executable is not None:
            _destroy_exec(executable)
        if graph is not None:
            _destroy(graph)


def capture(rt: CudaRuntime, fn: Callable[[], None]) -> CudaGraph:
    """Run `fn` under stream capture and instantiate what it enqueued.

    If `fn` raises, capture is ended and the partial graph discarded before the error
    propagates. `empty`, uploads and downloads raise `CaptureError` inside; workspaces the ops
    need may be created during capture, so no eager warm-up is required.
    """
    _begin(rt)
    try:
        fn()
    except BaseException:
        _abandon(rt)
        raise
    return _end(rt)


class CudaPieces:
    """Graphs with eager calls between them (`capture_pieces`)."""

    def __init__(self, graphs: list[CudaGraph], calls: list[Callable[[Any], None]]) -> None:
        self._graphs = graphs  # one more than the calls
        self._calls = calls

    def replay(self, arg: Any) -> None:
        for graph, call in zip(self._graphs, self._calls):
            graph.replay()
            call(arg)
        self._graphs[-1].replay()


def capture_pieces(rt: CudaRuntime, fn: Callable[[Callable[[Callable[[Any], None]], None]], None]) -> CudaPieces:
    """Capture `fn(cut)` piece by piece: each `cut(call)` ends the capture running (a piece,
    instantiated) and begins the next; `call` runs at every replay between the two pieces
    (the port's `Device.capture_pieces`). A piece that enqueued nothing is an empty graph."""
    graphs: list[CudaGraph] = []
    calls: list[Callable[[Any], None]] = []

    def cut(call: Callable[[Any], None]) -> None:
        graphs.append(_end(rt))
        calls.append(call)
        _begin(rt)

    _begin(rt)
    try:
        fn(cut)
    except BaseException:
        if rt.capturing:
            _abandon(rt)
        raise
    graphs.append(_end(rt))
    return CudaPieces(graphs, calls)


def _begin(rt: CudaRuntime) -> None:
    rt.ensure_current()
    if rt.capturing:
        raise RuntimeError("capture: already capturing (captures do not nest)")
    # Relaxed: a workspace may be allocated while capturing (cuMemAlloc is not a stream
    # operation); the ops themselves never synchronise.
    mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    check("cuStreamBeginCapture", cu.cuStreamBeginCapture(rt.stream_handle, mode))
    rt.capturing = True


def _abandon(rt: CudaRuntime) -> None:
    """End the capture running and discard what it recorded."""
    rt.capturing = False
    result, graph = cu.cuStreamEndCapture(rt.stream_handle)
    if result == cu.CUresult.CUDA_SUCCESS and graph is not None:
        cu.cuGraphDestroy(graph)


def _end(rt: CudaRuntime) -> CudaGraph:
    """End the capture running and instantiate its graph."""
    rt.capturing = False
    graph = check("cuStreamEndCapture", cu.cuStreamEndCapture(rt.stream_handle))
    try:
        early = launch_after_start(graph) if rt.features.launch_order_edges else 0
        executable = check("cuGraphInstantiate", cu.cuGraphInstantiate(graph, 0))
    except BaseException:
        cu.cuGraphDestroy(graph)
        raise
    return CudaGraph(rt, graph, executable, early)


def launch_after_start(graph: object) -> int:
    """Let each kernel that follows a kernel launched without programmatic serialization (a
    library's: cuBLASLt's never trigger their dependents) launch once that kernel's blocks have
    all started, instead of once they have all exited; returns how many edges changed.

    Capture gives such a pair a programmatic edge from the first kernel's programmatic port, which
    fires only as its blocks exit. Moved to the launch-order port, the second kernel's blocks can
    be resident while the first runs: they do what precedes their griddepcontrol.wait (which
    still waits for the first kernel to complete and its writes to be visible) during its run.
    That is safe because the first kernel started only after everything before it had completed,
    so what the second reads before its wait was final unless the first writes it, which no
    kernel of ours reads early (atlas_common.cuh). Edges out of kernels that were themselves
    launched programmatically stay as they are: those may still wait on their own predecessor.
    """
    count = check("cuGraphGetEdges", cu.cuGraphGetEdges(graph, 0))[3]
    if not count:
        return 0
    sources, targets, data, count = check("cuGraphGetEdges", cu.cuGraphGetEdges(graph, count))
    programmatic = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    launched_programmatically = {int(t) for t, d in zip(targets, data, strict=True) if d.type == programmatic}
    kernel = cu.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
    moved = []
    for source, target, edge in zip(sources, targets, data, strict=True):
        if (
            edge.type == programmatic
            and edge.from_port == cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
            and int(source) not in launched_programmatically
            and check("cuGraphNodeGetType", cu.cuGraphNodeGetType(source)) == kernel
        ):
            moved.append((source, target, edge))
    for source, target, edge in moved:
        check("cuGraphRemoveDependencies", cu.cuGraphRemoveDependencies(graph, [source], [target], [edge], 1))
        early = cu.CUgraphEdgeData()
        early.type = programmatic
        early.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER
        early.to_port = edge.to_port
        check("cuGraphAddDependencies", cu.cuGraphAddDependencies(graph, [source], [target], [early], 1))
    return len(moved)
