"""torch futures completed by the engine: the bridge both DDP integrations stand on."""
from __future__ import annotations

import collections
import threading
import warnings
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

import torch

from ..engine import PROGRESS_THREAD_NAME

__all__ = ["InFlight", "copy_back", "future_for", "inside_backward_node", "reducible"]

_CURRENT_NODE = getattr(torch._C, "_current_autograd_node", None)   # private to torch; 2.13 has it
_warned_no_node_query = False


def inside_backward_node() -> bool:
    """Whether a node of backward runs in this thread (DDP's reducer, in a gradient hook): only there
    may a bucket's allreduce wait until backward ends. A torch without the query answers False, so
    each bucket finishes at once and backward no longer overlaps its allreduces: said once."""
    global _warned_no_node_query
    if _CURRENT_NODE is None:
        if not _warned_no_node_query:
            _warned_no_node_query = True
            warnings.warn("mcallreduce.ddp: this torch has no torch._C._current_autograd_node; without the "
                          "progress thread each bucket's allreduce finishes when it starts, and backward "
                          "no longer overlaps them (set MCALLREDUCE_PROGRESS_THREAD=1)", RuntimeWarning, stacklevel=3)
        return False
    return _CURRENT_NODE() is not None


class _Completer:
    """Completes futures off the progress thread, on as many threads as completions block.

    torch runs a future's ``then`` callbacks in the thread that sets its result, and some
    callbacks wait on a later allreduce (PowerSGD's do): on the progress thread, which must
    finish that allreduce, they would wait forever. A completion is handed to an idle thread
    here, or to a new one when every thread is inside a callback (as Gloo's worker pool does).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: Deque[Callable[[], None]] = collections.deque()
        self._idle = 0    # threads waiting for work, or started and not yet waiting

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cond:
            self._work.append(fn)
            if self._idle > len(self._work) - 1:
                self._cond.notify()
                return
            self._idle += 1
        threading.Thread(target=self._serve, name="mcallreduce-completer", daemon=True).start()

    def _serve(self) -> None:
        with self._cond:
            while True:
                while not self._work:
                    self._cond.wait()
                fn = self._work.popleft()
                self._idle -= 1
                self._cond.release()
                try:
                    fn()
                finally:
                    fn = None   # an idle thread keeps no call's handle (nor, through it, its engine)
                    self._cond.acquire()
                    self._idle += 1


_COMPLETER = _Completer()


def _value(future: torch.futures.Future) -> Any:
    return future.value()   # raises the error set on it


def future_for(handle, value: Any, finish: Optional[Callable[[], None]] = None) -> torch.futures.Future:
    """A future that gets ``value`` when ``handle`` finishes (or its error), exactly once;
    ``finish`` runs first (copying a result back, say). It completes in the thread that
    finished the handle, or, when that is the progress thread, in a completer thread.

    Python's ``set_exception`` stores the exception as the future's *value*, which C++ readers
    (DDP's reducer) take for a result; the ``then`` step turns it into an error they see.
    """
    # a future holding CUDA tensors must name their device (torch checks); the result is on the
    # GPU before it completes (mcallreduce/gpu.py copies back first)
    cuda = isinstance(value, torch.Tensor) and value.is_cuda
    future: torch.futures.Future = torch.futures.Future(devices=[value.device] if cuda else None)

    def complete(h) -> None:
        error = h.error
        if error is None and finish is not None:
            try:
                finish()
            except BaseException as exc:   # noqa: BLE001  (the future reports it)
                error = exc
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def done(h) -> None:
        if threading.current_thread().name == PROGRESS_THREAD_NAME:
            _COMPLETER.submit(lambda: complete(h))
        else:
            complete(h)

    handle.add_done_callback(done)
    return future.then(_value)


def reducible(tensor: torch.Tensor):
    """(the tensor the engine reduces, a function copying its result into ``tensor`` or None).

    bfloat16 has no numpy type: it is reduced in float32 and rounded once at the end (more
    exact than a bfloat16 sum). A non-contiguous tensor is reduced in a contiguous copy.
    CUDA tensors are reduced through pinned host memory (mcallreduce/gpu.py).
    """
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"mcallreduce: {tensor.device.type} tensors are not supported; pass CPU or CUDA tensors")
    if tensor.layout != torch.strided:   # DDP's sparse gradients (nn.Embedding(sparse=True)) among them
        raise TypeError(f"mcallreduce: {tensor.layout} tensors are not supported (dense tensors only); "
                        "reduce sparse gradients on a gloo group")
    if tensor.dtype == torch.bfloat16:
        work = tensor.to(torch.float32, memory_format=torch.contiguous_format)
    elif not tensor.is_contiguous():
        work = tensor.contiguous()
    else:
        return tensor, None
    return work, lambda: copy_back(tensor, work)


def copy_back(tensor: torch.Tensor, result: torch.Tensor) -> None:
    """``tensor[...] = result`` outside autograd: a parameter that requires grad takes its
    reduced value as a collective writes it, not as an operation to differentiate."""
    with torch.no_grad():
        tensor.copy_(result)


class InFlight:
    """Allreduces in flight, oldest first, for progress driven by their caller (no progress thread).
    Their errors are left to their futures."""

    def __init__(self) -> None:
        self._entries: List[Tuple[Any, Optional[torch.futures.Future]]] = []

    def add(self, handle: Any, future: Optional[torch.futures.Future] = None) -> None:
        """``future``: the one whose completion copies the result back, which ``finish`` waits for."""
        self._entries.append((handle, future))

    def __iter__(self) -> Iterator[Any]:
        return iter([handle for handle, _ in self._entries])

    def advance(self, finish: bool) -> None:
        """Drop the finished ones from the front: waiting for each (and for its future, which the
        progress thread's completer may still be copying back), or testing until the oldest is
        still out (one test advances every allreduce in flight; with the thread on it only reads)."""
        while self._entries:
            oldest = self._entries[0]
            handle, future = oldest
            try:
                if finish:
                    handle.wait()
                    if future is not None:
                        future.wait()
                elif not handle.test():
                    return
            except Exception:   # noqa: BLE001  (its future carries the error)
                pass
            if self._entries and self._entries[0] is oldest:   # a future's callback may have dropped it
                self._entries.pop(0)
