"""torch futures completed by the engine: the bridge both DDP integrations stand on."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

__all__ = ["future_for", "reducible"]


def _value(future: torch.futures.Future) -> Any:
    return future.value()   # raises the error set on it


def future_for(handle, value: Any, finish: Optional[Callable[[], None]] = None) -> torch.futures.Future:
    """A future that gets ``value`` when ``handle`` finishes (or its error), exactly once, from
    whichever thread finishes it; ``finish`` runs first (copying a result back, say).

    Python's ``set_exception`` stores the exception as the future's *value*, which C++ readers
    (DDP's reducer) take for a result; the ``then`` step turns it into an error they see.
    """
    future: torch.futures.Future = torch.futures.Future()

    def done(h) -> None:
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

    handle.add_done_callback(done)
    return future.then(_value)


def reducible(tensor: torch.Tensor):
    """(the tensor the engine reduces, a function copying its result into ``tensor`` or None).

    bfloat16 has no numpy type: it is reduced in float32 and rounded once at the end (more
    exact than a bfloat16 sum). A non-contiguous tensor is reduced in a contiguous copy.
    """
    if tensor.device.type != "cpu":
        raise TypeError(f"mcallreduce: {tensor.device.type} tensors are not supported; the engine reduces "
                        "CPU memory (use a gloo or NCCL group for GPU tensors)")
    if tensor.dtype == torch.bfloat16:
        work = tensor.to(torch.float32, memory_format=torch.contiguous_format)
    elif not tensor.is_contiguous():
        work = tensor.contiguous()
    else:
        return tensor, None
    return work, lambda: tensor.copy_(work)
