"""The ``mcallreduce`` torch.distributed backend: a Python process group over the MPI world.

    import mcallreduce.ddp
    dist.init_process_group("mcallreduce")                     # under mpirun, no MASTER_ADDR needed
    # or: mcallreduce.ddp.init_process_group("mcallreduce"), or init_method="mcallreduce://"
    model = DistributedDataParallel(net)                       # buckets go through the engine

``allreduce`` runs on the engine (the multi-color allreduce by default) and returns a work
object whose future the engine completes: on the progress thread, or without it, for the futures
DDP asks for in backward, in an autograd callback queued then, which runs before the one DDP queues
after its last bucket to wait for them all. Until then each allreduce tests the oldest in flight, so
backward goes on while the buckets travel.

``broadcast``, ``allgather`` and ``barrier`` are MPI's own, run when called, after this group's
allreduces in flight (so a script sees its collectives in call order, as on gloo); DDP calls them
at construction, at the bucket rebuild and for buffers, not for gradients. Other collectives
raise NotImplementedError. Past the group's timeout (``init_process_group(timeout=...)``) a
collective raises RuntimeError, as gloo's do; an allreduce fails every allreduce in flight with
it (the stall inspector watches them), and the group is not usable after.

The group subclasses torch's public ``ProcessGroup`` and ``Work``; registering a Python
backend is marked experimental in torch 2.13.
"""
from __future__ import annotations

import datetime
import importlib
import sys
import time
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import Variable

from .. import policy
from .futures import InFlight, copy_back, future_for, inside_backward_node, reducible
from .rendezvous import env_or_mpi_rendezvous, mpi_rendezvous, require_mpi_ranks

__all__ = ["ProcessGroupMulticolor", "BACKEND", "register"]

BACKEND = "mcallreduce"

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "average", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max", dist.ReduceOp.PRODUCT: "product"}
_IMPLEMENTED = "allreduce, broadcast, allgather and barrier"
_TIMED_WAIT_NAP_S = 0.0005   # between tests of a wait with a timeout: the engine's own waits sleep too
_TIMED_WAIT_YIELDS = 1000    # tests before it naps between them (most collectives finish in microseconds)


def _wait_until(test: Callable[[], bool], seconds: Optional[float], on_timeout: Callable[[], BaseException]) -> None:
    """Test until ``test()`` is true; past ``seconds`` (None: no limit) raise ``on_timeout()``.
    Yields the core between tests at first, then naps."""
    deadline = None if seconds is None else time.monotonic() + seconds
    tests = 0
    while not test():
        if deadline is not None and time.monotonic() >= deadline:
            raise on_timeout()
        tests += 1
        time.sleep(0 if tests < _TIMED_WAIT_YIELDS else _TIMED_WAIT_NAP_S)


class _Work(dist.Work):
    """A collective of this group; ``wait()`` drives the engine when no progress thread does.

    ``defer`` is None where the progress thread completes the future. Otherwise ``get_future()``
    finishes the allreduce first, unless DDP asks for it in backward: then ``defer()`` queues the
    callback that finishes it when backward ends.
    """

    def __init__(self, handle: Any, future: torch.futures.Future, defer: Optional[Callable[[], None]] = None):
        super().__init__()
        self._handle, self._future, self._defer = handle, future, defer

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Wait for the collective; past ``timeout`` (none or zero: no limit, as torch's) raise
        RuntimeError, as gloo does. The collective stays in flight; a later wait finishes it."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if self._handle is not None and seconds > 0:   # each test progresses it when no thread does
            _wait_until(self._handle.test, seconds, lambda: RuntimeError(
                f"mcallreduce: the collective did not finish within {timeout} (Work.wait timeout); it is still in flight"))
        elif self._handle is not None:
            self._handle.wait()
        self._future.wait()   # the callback that completes it may still be running
        return True

    def is_completed(self) -> bool:
        if self._handle is not None and not self._future.done():
            try:
                self._handle.test()   # progresses it where no thread does
            except Exception:   # noqa: BLE001  (the future carries the error)
                pass
        return self._future.done()

    def result(self) -> List[torch.Tensor]:
        """The collective's output tensors, once it is finished (torch's ``Work.result()``)."""
        self.wait()
        value = self._future.value()
        return list(value) if value is not None else []

    def get_future(self) -> torch.futures.Future:
        defer, self._defer = self._defer, None
        if defer is not None and _asked_by_ddp(sys._getframe(1)):
            defer()
        elif defer is not None:
            try:
                self._handle.wait()
            except Exception:   # noqa: BLE001  (the future carries the error)
                pass
        return self._future


_RUN_BACKWARD = getattr(getattr(torch.autograd.graph, "_engine_run_backward", None), "__code__", None)


def _asked_by_ddp(caller) -> bool:
    """Whether a future is asked for from C++ (the last Python frame is the one that started backward)
    while a node of backward runs: DDP's reducer in a gradient hook, which waits on it only at the end
    of backward. Not a hook's or a script's Python, which may wait on it at once, and not inside an
    end-of-backward callback (DDP's first static-graph step reduces there)."""
    return caller is not None and caller.f_code is _RUN_BACKWARD and inside_backward_node()


def _done(value: Any) -> _Work:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return _Work(None, future)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a writable uint8 view (collectives that only move data)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"mcallreduce backend: expected a CPU tensor, got {tensor.device}")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy of it that the caller copies back (as gloo stages strided tensors)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class ProcessGroupMulticolor(dist.ProcessGroup):
    """Every rank of an MPI communicator (default COMM_WORLD) as a torch process group."""

    def __init__(self, rank: int, size: int, comm: Any = None, progress_thread: Optional[bool] = None,
                 timeout: Optional[datetime.timedelta] = None):
        super().__init__(rank, size)
        # init_process_group(timeout=...): how long any of its collectives waits, as on gloo
        self._timeout = timeout if timeout is not None and timeout.total_seconds() > 0 else None
        self._abandoned: List[Any] = []   # side collectives that timed out, still posted
        from mpi4py import MPI
        from .. import runtime
        world = comm if comm is not None else MPI.COMM_WORLD
        require_mpi_ranks(rank, size, world, "mcallreduce backend",
                          "; the group is the MPI world, so a subset (new_group(ranks=...)) is not supported")
        self._comm = world.Dup()                       # its allreduces: an engine of its own
        self._side = world.Dup()                       # broadcast, allgather, barrier
        self._allreduce_async = runtime.allreduce_async
        context = runtime.Context.get(self._comm)
        if progress_thread is None:
            progress_thread = policy.progress_thread(context.hosts)
        if progress_thread:
            runtime.start_progress_thread(self._comm)
        self._threaded = context.engine.threaded
        self._in_flight = InFlight()
        self._context = context
        if self._timeout is not None:   # its allreduces too, as gloo's and NCCL's watchdog bound theirs
            context.engine.limit_calls(self._timeout.total_seconds(), f"the process group's timeout ({self._timeout})")

    def shutdown(self) -> None:
        """destroy_process_group(): the group's engine stops (its threads end; the peers get its goodbye)."""
        try:
            self._finish_allreduces()
        finally:
            self._context.release()   # collective, as destroy_process_group is: the window, the engine
            self._context = None        # a model kept after destroy_process_group keeps its group, not the engine
            self._side.Free()
            self._comm.Free()

    def getBackendName(self) -> str:   # noqa: N802  (torch's name)
        return BACKEND

    # ------------------------------------------------------------------ implemented
    # Each takes ProcessGroup's shorthand forms too (a bare tensor, an op, a root rank), as DDP
    # itself calls ``allreduce(tensor)`` to match unused parameters under join().
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        reduce_op = getattr(opts, "reduceOp", opts) if opts is not None else dist.ReduceOp.SUM
        kind = getattr(reduce_op, "op", reduce_op)   # a ReduceOp wraps its RedOpType
        op = _OPS.get(kind)
        if op is None:
            raise ValueError(f"mcallreduce backend: reduce op {getattr(kind, 'name', kind)} is not supported; "
                             "supported: SUM, AVG, MIN, MAX, PRODUCT")
        if len(tensors) != 1:
            raise ValueError(f"mcallreduce backend: allreduce of {len(tensors)} tensors per call; pass one")
        tensor = tensors[0]
        if tensor.device.type != "cpu":   # registered for CPU; GPU buckets go to the hook on a gloo group
            raise ValueError(f"mcallreduce backend: expected a CPU tensor, got {tensor.device}; on the GPU "
                             "use mcallreduce.ddp.multicolor_hook on a gloo group")
        work, finish = reducible(tensor)
        handle = self._allreduce_async(work, op=op, comm=self._comm)
        future = future_for(handle, [tensor], finish)
        self._in_flight.add(handle, future)
        self._in_flight.advance(finish=False)
        return _Work(handle, future, None if self._threaded else self._finish_at_end_of_backward)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        root = opts if isinstance(opts, int) else opts.rootRank if opts is not None else 0
        self._finish_allreduces()
        for tensor in tensors:
            dense = _dense(tensor)
            self._side_wait(self._side.Ibcast(_bytes(dense), root=root), "broadcast")
            if dense is not tensor:
                copy_back(tensor, dense)
        return _done(tensors)

    def allgather(self, output_tensors: List, input_tensors: Any, opts: Any = None) -> dist.Work:
        if isinstance(input_tensors, torch.Tensor):   # allgather(outputs, tensor)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        self._finish_allreduces()
        for outputs, tensor in zip(output_tensors, input_tensors):
            mine = _bytes(_dense(tensor))
            sizes = np.empty(self.size(), np.int64)
            self._side_wait(self._side.Iallgather(np.array([mine.size], np.int64), sizes), "allgather")
            if len(set(sizes.tolist())) != 1 or len(outputs) != self.size():
                raise ValueError(f"mcallreduce backend: allgather of {sizes.tolist()} bytes from the ranks into "
                                 f"{len(outputs)} outputs; every rank must send the same size, one output a rank")
            gathered = np.empty(mine.size * self.size(), np.uint8)
            self._side_wait(self._side.Iallgather(mine, gathered), "allgather")
            for r, out in enumerate(outputs):
                dense = _dense(out)
                _bytes(dense)[...] = gathered[r * mine.size:(r + 1) * mine.size]
                if dense is not out:
                    copy_back(out, dense)
        return _done(output_tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        self._finish_allreduces()
        self._side_wait(self._side.Ibarrier(), "barrier")
        return _done(None)

    def _side_wait(self, request: Any, collective: str) -> None:
        """Wait for a broadcast, allgather or barrier; past the group's timeout raise RuntimeError,
        as gloo does, where a rank that failed or never calls it would leave this one waiting for ever
        (the request stays posted: the group is not usable after)."""
        def timed_out() -> BaseException:
            self._abandoned.append(request)   # it holds its buffer, which MPI may still write
            return RuntimeError(f"mcallreduce backend: {collective} did not finish within {self._timeout} "
                                "(the process group's timeout): a rank failed, or did not call it")
        _wait_until(request.Test, None if self._timeout is None else self._timeout.total_seconds(), timed_out)

    def _finish_at_end_of_backward(self) -> None:
        """Queue the callback that finishes the allreduces in flight when this backward ends (it runs
        before the one DDP queues after its last bucket, which waits on their futures)."""
        Variable._execution_engine.queue_callback(self._finish_allreduces)

    def _finish_allreduces(self) -> None:
        self._in_flight.advance(finish=True)


# Collectives this group refuses, by method name, with the name a user calls them by.
_REFUSED = {
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor", "_allgather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_single", "reduce_scatter_single": "reduce_scatter_single",
    "all_gather_single_coalesced": "all_gather_single", "reduce_scatter_single_coalesced": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor", "all_to_all_single": "all_to_all_single",
    "allgather_coalesced": "allgather_coalesced", "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced",
    "allreduce_coalesced": "allreduce_coalesced", "alltoall": "all_to_all", "alltoall_base": "all_to_all_single",
    "send": "send", "recv": "recv", "recv_anysource": "recv_anysource", "monitored_barrier": "monitored_barrier",
}


def _refusal(collective: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"mcallreduce backend: {collective} is not implemented (it implements "
                                  f"{_IMPLEMENTED}); run it on a gloo group: dist.new_group(backend='gloo')")
    refuse.__name__ = collective
    return refuse


for _method, _collective in _REFUSED.items():
    setattr(ProcessGroupMulticolor, _method, _refusal(_collective))


def _create(store, rank: int, world_size: int, timeout) -> ProcessGroupMulticolor:
    return ProcessGroupMulticolor(rank, world_size, timeout=timeout)


def register() -> None:
    """Make ``"mcallreduce"`` a torch.distributed backend and ``mcallreduce://`` an init method,
    and let ``env://`` rendezvous over MPI where an MPI launcher set no ``MASTER_ADDR``
    (idempotent; done on ``import mcallreduce.ddp``)."""
    # the module: the package exports a function of the same name
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    try:
        rendezvous.register_rendezvous_handler(BACKEND, mpi_rendezvous)
    except RuntimeError:   # registered already
        pass
    # torch has no public way to replace a scheme's handler; its table is module-private.
    handlers = rendezvous._rendezvous_handlers
    if not hasattr(handlers.get("env"), "env_handler"):
        handlers["env"] = env_or_mpi_rendezvous(handlers["env"])
