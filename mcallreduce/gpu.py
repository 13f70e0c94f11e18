"""GPU buffers (CUDA torch tensors, CuPy arrays): reduced in page-locked host memory.

The executor reduces host memory over MPI, which need not be CUDA-aware. A GPU buffer is
copied into a pinned host buffer when its allreduce starts, reduced there, and copied back
before its handle reports it done, so ``wait()``, ``test()`` and done-callbacks see the
result on the GPU. The copy to the host runs on the caller's current CUDA stream (so it sees
the work queued before the call). The copy back of a call that may have let the caller go on
(asynchronous, or finished by another thread) runs on a stream of its own per device, so that
it never waits behind the caller's later work; a blocking call finished at once copies back on
the caller's stream, which has nothing new on it and costs less to reach. Both are waited for.
Pinned buffers are pooled by size: pinning memory costs far more than copying into it. The
pool keeps a bounded amount; what it lets go returns to torch's or CuPy's own pinned cache.
docs/gpu.md has what the copies cost, measured.
"""
from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["is_gpu_buffer", "Staging", "StagingError"]

_MIN_CLASS_BYTES = 1 << 16   # pinned buffers come in powers of two from here, so near sizes share one
_FREE_PER_CLASS = 4          # released buffers kept per size; more go back to the library's cache
_FREE_BYTES = 1 << 30        # and at most this much in all, whatever the mix of sizes
_QUARANTINED = 4             # failed calls' buffers held (never reused) before the oldest is let go


class StagingError(RuntimeError):
    """Copying a GPU buffer to pinned host memory failed (no pinned memory left, a CUDA error)."""


def _is_torch(buf: Any) -> bool:
    torch = sys.modules.get("torch")   # never imported here: a CuPy user need not have torch
    return torch is not None and isinstance(buf, torch.Tensor)


def is_gpu_buffer(buf: Any) -> bool:
    """Whether ``buf`` is in GPU memory: a CUDA torch tensor, a CuPy array, or any object with
    ``__cuda_array_interface__``."""
    if buf is None or isinstance(buf, np.ndarray):
        return False
    if _is_torch(buf):
        return buf.device.type == "cuda"
    try:
        return hasattr(buf, "__cuda_array_interface__")
    except Exception:   # noqa: BLE001  (a property that raises: not a buffer this can reduce)
        return False


_COPY_STREAMS: Dict[Tuple[str, int], Any] = {}
_COPY_STREAMS_LOCK = threading.Lock()


def _copy_stream(key: Tuple[str, int], make) -> Any:
    """The stream the copies back run on, one per library and device: not the finishing thread's
    default stream, where the copy would wait for everything the training queued there."""
    with _COPY_STREAMS_LOCK:
        if key not in _COPY_STREAMS:
            _COPY_STREAMS[key] = make()
        return _COPY_STREAMS[key]


class _Torch:
    """CUDA torch tensors, staged through pinned torch tensors."""
    name = "torch"

    @staticmethod
    def device_view(buf):
        if not buf.is_contiguous():
            raise ValueError("mcallreduce: tensor is not contiguous; call .contiguous() first")
        return buf.detach()   # the same memory; a parameter that requires grad is written as on the host

    @staticmethod
    def device_of(buf) -> Tuple[str, int]:
        return "cuda", buf.device.index

    @staticmethod
    def pinned(nbytes: int):
        import torch
        owner = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return owner, owner

    @staticmethod
    def host_view(raw, like):
        return raw[:like.numel() * like.element_size()].view(like.dtype)   # stays a pinned torch tensor

    @staticmethod
    def empty_host(like):
        import torch
        return torch.empty(0, dtype=like.dtype)

    @staticmethod
    def to_host(src, host) -> None:
        host.copy_(src.reshape(-1))      # blocking: waits for the work queued on the current stream

    @staticmethod
    def to_device(host, dst, own_stream: bool) -> None:
        if not own_stream:
            dst.reshape(-1).copy_(host)   # blocking, on the current stream
            return
        import torch
        stream = _copy_stream(("torch", dst.device.index), lambda: torch.cuda.Stream(dst.device))
        with torch.cuda.stream(stream):
            dst.reshape(-1).copy_(host, non_blocking=True)
        stream.synchronize()


class _CuPy:
    """CuPy arrays and other ``__cuda_array_interface__`` objects (viewed through CuPy)."""
    name = "cupy"

    @staticmethod
    def device_view(buf):
        try:
            import cupy
        except ImportError as exc:
            raise TypeError(f"mcallreduce: {type(buf).__name__} is a GPU array; install CuPy to reduce it "
                            "(or pass a CUDA torch tensor)") from exc
        arr = cupy.asarray(buf)   # a view, no copy
        if not arr.flags.c_contiguous:
            raise ValueError("mcallreduce: GPU array is not contiguous; pass cupy.ascontiguousarray(buf)")
        return arr

    @staticmethod
    def device_of(arr) -> Tuple[str, int]:
        return "cuda", arr.device.id

    @staticmethod
    def pinned(nbytes: int):
        import cupy
        owner = cupy.cuda.alloc_pinned_memory(nbytes)
        return owner, np.frombuffer(owner, np.uint8, nbytes)

    @staticmethod
    def host_view(raw, like):
        return raw[:like.nbytes].view(like.dtype)

    @staticmethod
    def empty_host(like):
        return np.empty(0, like.dtype)

    @staticmethod
    def to_host(src, host) -> None:
        with src.device:
            src.reshape(-1).get(out=host)   # blocking, on the current stream

    @staticmethod
    def to_device(host, dst, own_stream: bool) -> None:
        import cupy
        with dst.device:
            stream = (_copy_stream(("cupy", dst.device.id), lambda: cupy.cuda.Stream(non_blocking=True))
                      if own_stream else cupy.cuda.get_current_stream())
            dst.reshape(-1).set(host, stream=stream)   # from pinned memory this copy is asynchronous
            stream.synchronize()


class _PinnedPool:
    """Released pinned buffers, by library and size class, for the next call of a similar size."""

    def __init__(self, free_bytes: int = _FREE_BYTES) -> None:
        self._lock = threading.Lock()
        self._free: Dict[Tuple[str, int], List[Tuple[Any, Any]]] = {}
        self.free_bytes, self._cap = 0, free_bytes
        self._quarantine: Deque[Tuple[Any, Any]] = collections.deque(maxlen=_QUARANTINED)

    def take(self, lib, nbytes: int) -> Tuple[Tuple[str, int], Any, Any]:
        size = max(_MIN_CLASS_BYTES, 1 << max(0, nbytes - 1).bit_length())
        key = (lib.name, size)
        with self._lock:
            free = self._free.get(key)
            if free:
                self.free_bytes -= size
                return (key, *free.pop())
        return (key, *lib.pinned(size))

    def give(self, key: Tuple[str, int], buffer: Tuple[Any, Any]) -> None:
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < _FREE_PER_CLASS and self.free_bytes + key[1] <= self._cap:
                free.append(buffer)
                self.free_bytes += key[1]

    def quarantine(self, buffer: Tuple[Any, Any]) -> None:
        """Hold a failed call's buffer: a peer's late message may still land in it, and memory let
        go would be handed out again at once by the library's pinned cache."""
        with self._lock:
            self._quarantine.append(buffer)


_POOL = _PinnedPool()


class Staging:
    """One GPU allreduce's trip through pinned host memory.

    ``host`` (a numpy view) is what the executor reduces; :meth:`finish` copies the result to
    the GPU (``out``, else ``buf``) unless the call failed, and releases the host buffer.
    Raises TypeError or ValueError, before taking pinned memory, for what cannot be reduced,
    and StagingError when pinning or copying fails.
    """

    def __init__(self, buf: Any, out: Any = None):
        from .memory import as_array   # here, not at import: the pool is usable without MPI
        if not is_gpu_buffer(buf) or (out is not None and not is_gpu_buffer(out)):
            raise ValueError("mcallreduce: buf and out must both be GPU buffers or both host buffers")
        self._lib = _Torch if _is_torch(buf) else _CuPy
        src = self._lib.device_view(buf)
        dst = src
        if out is not None:
            if _is_torch(out) != (self._lib is _Torch):
                raise TypeError("mcallreduce: buf and out must both be torch tensors or both CuPy arrays")
            dst = self._lib.device_view(out)
            if self._lib.device_of(dst) != self._lib.device_of(src):
                raise ValueError(f"mcallreduce: out is on {self._lib.device_of(dst)}, buf on "
                                 f"{self._lib.device_of(src)}")
        nbytes = src.nbytes
        if dst is not src and (dst.dtype != src.dtype or dst.nbytes != nbytes):
            raise ValueError(f"mcallreduce: out has {dst.nbytes} bytes of {dst.dtype}, buf {nbytes} of {src.dtype}")
        as_array(self._lib.empty_host(src))   # the dtype checks of host buffers, before pinning anything
        try:
            self._key, owner, raw = _POOL.take(self._lib, nbytes)
            self._buffer = (owner, raw)
            host = self._lib.host_view(raw, src)
            self.host = as_array(host)
            self._lib.to_host(src, host)
        except Exception as exc:   # noqa: BLE001  (no pinned memory left, a CUDA error: raised on every rank)
            raise StagingError(f"mcallreduce: staging the GPU buffer in pinned host memory failed: {exc}") from exc
        self._host, self._dst = host, dst

    def abandon(self) -> None:
        """The call never started: give the host buffer back for the next one."""
        _POOL.give(self._key, self._buffer)
        self._host = self._dst = self._buffer = self.host = None

    def finish(self, error: Optional[BaseException], on_callers_stream: bool = False) -> Optional[BaseException]:
        """After the reduction (``error`` is its outcome): the call's outcome once copied back.
        ``on_callers_stream``: the caller has been inside the call since it was staged, on this
        thread, so its stream has nothing queued after the copy to the host."""
        if error is None:
            try:
                self._lib.to_device(self._host, self._dst, own_stream=not on_callers_stream)
            except Exception as exc:   # noqa: BLE001  (the handle reports it)
                error = RuntimeError(f"mcallreduce: copying the result back to the GPU failed: {exc}")
                error.__cause__ = exc
        if error is None:
            _POOL.give(self._key, self._buffer)
        else:
            _POOL.quarantine(self._buffer)
        self._host = self._dst = self._buffer = self.host = None
        return error
