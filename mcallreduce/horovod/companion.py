"""The companion metadata allreduce that every routed allreduce starts just before its data.

Horovod matches tensors across ranks by name through its coordinator; our engine, like MPI,
matches collectives by the order in which they are started. The plugin therefore requires
every rank to *start* its routed allreduces in the same order (they may be synchronized in
any order). That holds for the usual script (metrics, SyncBatchNorm, DistributedOptimizer,
which launches its buckets in a fixed order). It is checked, not assumed: each routed
allreduce carries a tiny companion allreduce of its metadata (name, shape and op
fingerprints, scale factors, element count and dtype of each engine call), and the engine
checks element count, dtype and scaling before any data moves; any difference raises
HorovodInternalError naming the tensor, on every rank, instead of hanging or mixing up
tensors. Matching by name instead (Horovod's coordinator) is not attempted: the error
message tells users of rank-dependent orders to set MCALLREDUCE_HOROVOD=0.

The vector is reduced with MAX over ``[fields, -fields]``, which gives every field's maximum
and minimum in one call. Every field is in [0, 2**56); a rank inside hvd.join() sends
``_NEUTRAL`` (below any real value) for all but the first, so the others' fields come
through unchanged and tell it what to contribute zeros to.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import check

_MAX56 = (1 << 56) - 1
#: the dtypes routed calls carry, with the engine's codes: those stock Horovod's torch allreduce takes
#: (it refuses 8- and 16-bit integers and bool: so does the plugin, by leaving them to it)
DTYPE_CODE = {getattr(torch, name): check.DTYPE_CODE[np.dtype(name)]
              for name in ("float16", "float32", "float64", "int32", "int64")}
_DTYPE_OF = {code: dtype for dtype, code in DTYPE_CODE.items()}
_OP_CODE = {op: check.OP_CODE[op] for op in ("sum", "average")}    # the ops Horovod routes here
_OP_OF = {code: op for op, code in _OP_CODE.items()}
MAX_PARTS = len(DTYPE_CODE)     # engine calls per routed allreduce: one per dtype at most
_HEAD = ("joined", "name", "shape", "op", "number of dtypes",
         "prescale_factor", "prescale_factor", "postscale_factor", "postscale_factor")
_FIELDS = _HEAD + ("element count", "dtype") * MAX_PARTS
_NEUTRAL = -(1 << 62)

#: the remedy every order or metadata mismatch names
ORDER_ADVICE = ("The mcallreduce plugin matches allreduces by the order in which ranks start them (as "
                "MPI does), not by name as stock Horovod does: every rank must start its allreduces in the "
                "same order with the same names, shapes, dtypes and ops. A script that starts them in a "
                "rank-dependent order must run stock Horovod: set MCALLREDUCE_HOROVOD=0.")


@functools.lru_cache(maxsize=4096)
def fingerprint(text: str) -> int:
    """Stable 56-bit hash (Python's hash() is salted per process, useless across ranks)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") & _MAX56


def _float_fields(x: float) -> List[int]:
    bits = struct.unpack("<Q", struct.pack("<d", float(x)))[0]
    return [bits >> 32, bits & 0xFFFFFFFF]


def _float_of(high: int, low: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", (int(high) << 32) | int(low)))[0]


def metadata_vector(name: str, shapes: str, op: str, prescale: float, postscale: float,
                    buffers: Sequence[torch.Tensor]) -> np.ndarray:
    """What a working rank sends in the companion allreduce."""
    if len(buffers) > MAX_PARTS:
        raise ValueError(f"mcallreduce: {len(buffers)} engine calls for one allreduce (at most {MAX_PARTS})")
    fields = [0, fingerprint(name), fingerprint(shapes), _OP_CODE[op], len(buffers),
              *_float_fields(prescale), *_float_fields(postscale)]
    for i in range(MAX_PARTS):
        fields += [buffers[i].numel(), DTYPE_CODE[buffers[i].dtype]] if i < len(buffers) else [0, 0]
    return check.min_max_vector(fields)


def joined_vector() -> np.ndarray:
    """What a rank inside hvd.join() sends: the joined marker, neutral everywhere else."""
    vec = np.full(2 * len(_FIELDS), _NEUTRAL, dtype=np.int64)
    vec[0], vec[len(_FIELDS)] = 1, -1
    return vec


def mismatch(result: np.ndarray) -> Optional[str]:
    """The first field on which the ranks that have not joined disagree, or None."""
    high, low = check.bounds(result)
    for i in range(1, len(_FIELDS)):
        if high[i] != low[i]:
            return _FIELDS[i]
    return None


def next_call(result: np.ndarray) -> Optional[Tuple[str, float, float, List[Tuple[int, torch.dtype]]]]:
    """A joined rank's reading of a round: None when every rank sent the joined marker, else
    the working ranks' next routed allreduce as (op, prescale, postscale, [(count, dtype)])."""
    high, low = check.bounds(result)
    if low[0] == 1:
        return None
    op = _OP_OF.get(int(high[3]), "sum")
    pre, post = _float_of(high[5], high[6]), _float_of(high[7], high[8])
    parts = []
    for i in range(min(int(high[4]), MAX_PARTS)):
        count, code = int(high[len(_HEAD) + 2 * i]), int(high[len(_HEAD) + 2 * i + 1])
        parts.append((count, _DTYPE_OF.get(code, torch.float32)))
    return op, pre, post, parts
