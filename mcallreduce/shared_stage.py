"""The one-host shared-memory stage: its window's layout, and its sequence in numpy for the tests.

The runtime lays out its window with :func:`areas` and :func:`small_areas` (memory.SharedWindow)
and runs the sequence in C (native/shared_stage.c); the tests play the functions below
in-process. No MPI import here.

When every rank of a communicator shares one host, multicolor's hierarchy has only
its local stages: every local rank reduces one color (a contiguous slice of the
buffer) from all ranks' data, then every rank gathers all colors. Through messages
that is two dependent rounds of point-to-point copies after a metadata check, three
synchronisations in all. Through a window that every local rank maps, it is:

1. **publish**: each rank copies its buffer (prescaled) into its slot of the window,
   all but its own color when there is no prescale (it reduces that from its buffer);
   *sync 1*: the ranks exchange their metadata vectors (a recursive doubling). Once it
   has completed, every rank's data is in the window and every rank has checked
   that the calls match: the cross-rank check costs nothing extra, it *is* the
   synchronisation.
2. **reduce**: rank c folds color c of every slot, in rank order, into color c of
   the result area. *sync 2*: a one-byte message to every other rank.
3. **collect**: each rank copies the result area into its buffer.

From ``MCALLREDUCE_SINGLE_COPY_BYTES`` on, where the kernel lets ranks read and write each
other's memory (Linux CMA), the stage skips the window: after sync 1 (each rank's slot now
holds only where its buffer is), rank c folds color c of every rank's buffer, read straight
from it, into its own buffer, and writes the result into every peer's buffer
(:func:`reduce_color_direct`); sync 2 ends the call. Rank c reads and writes only color c of
any buffer, so no rank reads a range another writes.

Each value is computed once, by its color's owner, so every rank holds bitwise the
same result, and the fold order is fixed, so repeated runs agree too.

Up to ``MCALLREDUCE_ONE_SYNC_BYTES`` the stage synchronises once: each rank copies its
whole buffer into one of its two small slots (the parity of the stage calls so far), and
after sync 1 folds every rank's small slot, in the same rank order, into its own buffer
(:func:`reduce_whole`). Every rank computes every value, in the same order, so the result is
bitwise the same as the two-sync stage's. The slot written in call k is written again in
call k+2, and a rank publishes call k+2 only after its call k+1 is checked, which needs every
peer to have published k+1, which a peer does only after finishing k.

Why two syncs suffice from one call to the next (the engine runs one shared-memory
call at a time, in call order: mcallreduce/engine.py): a rank publishes call k+1
only after every peer's sync 2 of call k, so no peer still reads its slot; it writes
the result area in call k+1 only after every peer's sync 1 of call k+1, which a peer
sends only once it has collected call k. (If that peer's call k+1 is not a shared
one, the two calls differ, the check fails on every rank and nobody writes.)

The functions below work on plain numpy views of the window, so the in-process tests
run exactly this code over p virtual ranks (tests/test_shared_stage.py); the runtime
runs the same sequence in C on an MPI shared-memory window (native/shared_stage.c, memory.SharedWindow).
Cost: docs/algorithms.md, "Shared memory (one host)".
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .schedule import split_even

__all__ = ["ALIGN", "areas", "small_areas", "colors", "publish", "sources", "reduce_color", "collect",
           "reduce_color_direct", "reduce_whole", "scale_"]

ALIGN = 4096   # slots start on page boundaries


def areas(nranks: int) -> int:
    """Areas of one slot size in the window: one slot per rank, then the result area."""
    return nranks + 1


def small_areas(nranks: int) -> int:
    """Small slots after the areas, for one-sync calls: two per rank, used in turn."""
    return 2 * nranks


def colors(nelem: int, nranks: int) -> List[Tuple[int, int]]:
    """(offset, count) of every color: color c is reduced by local rank c."""
    return split_even(nelem, nranks)


def publish(arr: np.ndarray, slot: np.ndarray, color: int, nranks: int,
            scale: Optional[Callable[[np.ndarray], None]]) -> None:
    """Step 1 on local rank ``color``: copy this rank's buffer into its slot. With a ``scale``
    (the prescale, applied to the copy: the caller's buffer stays untouched until the check
    has passed) all of it; without, all but the rank's own color, which :func:`reduce_color`
    then reads from the buffer itself (a 1 MiB call on 2 ranks copies 512 KiB less)."""
    if scale is not None:
        slot[...] = arr
        scale(slot)
        return
    lo, count = colors(arr.size, nranks)[color]
    slot[:lo] = arr[:lo]
    slot[lo + count:] = arr[lo + count:]


def sources(slots: Sequence[np.ndarray], arr: np.ndarray, color: int, scaled: bool) -> List[np.ndarray]:
    """Where :func:`reduce_color` on local rank ``color`` reads each rank's data: the slots,
    but its own buffer for its own data when :func:`publish` did not copy that."""
    return list(slots) if scaled else [arr if q == color else s for q, s in enumerate(slots)]


def reduce_color(data: Sequence[np.ndarray], result: np.ndarray, color: int, ufunc: Callable) -> None:
    """Step 2, on local rank ``color``: result = op(...op(op(data 0, data 1), data 2)..., data p-1)
    over color ``color`` (at least two ranks; ``data`` from :func:`sources`)."""
    lo, count = colors(result.size, len(data))[color]
    reduce_whole([d[lo:lo + count] for d in data], result[lo:lo + count], ufunc)


def collect(arr: np.ndarray, result: np.ndarray) -> None:
    """Step 3: copy the result area into ``arr``."""
    arr[...] = result


def reduce_color_direct(buffers: Sequence[np.ndarray], color: int, ufunc: Callable, chunk: int) -> None:
    """Single copy, step 2 on local rank ``color``: the same fold as :func:`reduce_color`, of
    color ``color`` of every rank's buffer into this rank's own, ``chunk`` elements at a time
    (the ranks below first, then its own data, then the ranks above), each chunk then
    written into every peer's buffer (native/shared_stage.c does it through the kernel)."""
    mine_all = buffers[color]
    lo, count = colors(mine_all.size, len(buffers))[color]
    for at in range(lo, lo + count, chunk):
        part = slice(at, min(at + chunk, lo + count))
        mine = mine_all[part]
        if color > 0:
            prefix = buffers[0][part].copy()
            for below in buffers[1:color]:
                ufunc(prefix, below[part], out=prefix)
            ufunc(prefix, mine, out=mine)
        for above in buffers[color + 1:]:
            ufunc(mine, above[part], out=mine)
        for q, peer in enumerate(buffers):
            if q != color:
                peer[part] = mine


def reduce_whole(slots: Sequence[np.ndarray], arr: np.ndarray, ufunc: Callable) -> None:
    """One sync, after it: ``arr`` = op(...op(op(slot 0, slot 1), slot 2)..., slot p-1), every
    rank's whole (prescaled) copy in its small slot (at least two ranks); :func:`reduce_color`
    folds one color the same way."""
    ufunc(slots[0], slots[1], out=arr)
    for other in slots[2:]:
        ufunc(arr, other, out=arr)


def scale_(arr: np.ndarray, factor: float) -> None:
    """arr *= factor in place, as Horovod scales CPU buffers and the executor does
    (native/kernels.h): float16 through float32 with one rounding, float32 and float64 in
    their own type, integers in float64 and truncated."""
    if factor == 1.0:
        return
    if arr.dtype == np.float16:
        arr[...] = (arr.astype(np.float32) * np.float32(factor)).astype(np.float16)
    elif arr.dtype.kind == "f":
        np.multiply(arr, arr.dtype.type(factor), out=arr)
    else:
        arr[...] = (arr.astype(np.float64) * factor).astype(arr.dtype)
