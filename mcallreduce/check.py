"""The cross-rank metadata check: the vector every rank sends, and the error it turns into
(the executor exchanges it: native/check.c).

Every call carries a vector of its element count, dtype, algorithm, op and schedule
parameters. The check reduces ``[fields, -fields]`` with MAX, which gives every field's
maximum and minimum in one allreduce: the result equals a rank's own vector exactly when
every rank sent the same one. Slot ``n`` carries the lowest rank that rejected its own
arguments (as ``-rank``), so every rank can name it. The last slot of each half is not
compared: it carries what the ranks decide together. The first half's says whether any of
them cannot wait for MPI's own allreduce in a blocking call, which MPI never matches with a
nonblocking one; the second half's whether any sent data before the check (native/early.c),
after which every rank drains the others' messages if the check fails. No MPI here.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .errors import MismatchError

__all__ = ["DTYPES", "DTYPE_CODE", "OP_CODE", "FIELDS", "REJECT_BUFFER", "REJECT_CONFIG", "VECTOR_BYTES", "vector",
           "mismatch", "min_max_vector", "bounds"]

#: supported element types (numpy names), in the executor's dtype codes (1, 2, ...)
DTYPES = ("float16", "float32", "float64", "int32", "int64", "int8", "uint8", "int16", "uint16", "bool")
DTYPE_CODE = {np.dtype(name): i + 1 for i, name in enumerate(DTYPES)}
#: reduction operators in the executor's op codes; "average" is "sum" then a scale
OP_CODE = {"sum": 1, "average": 2, "min": 3, "max": 4, "product": 5}
FIELDS = ("element count", "dtype", "algorithm", "op", "colors", "segment", "fanout",
          "hierarchy", "pipeline depth", "shared-memory stage", "scale factors", "route")
REJECT_BUFFER, REJECT_CONFIG = 1, 2
#: bytes of the vector every rank sends: [reject, *FIELDS, agreed] and its negation, int64;
#: ``agreed`` and its negation's slot (the executor sets both per call) are MAX-reduced, never compared
VECTOR_BYTES = 2 * (2 + len(FIELDS)) * 8
_REJECT_REASONS = {REJECT_BUFFER: "unsupported buffer", REJECT_CONFIG: "invalid configuration"}


def min_max_vector(fields) -> np.ndarray:
    """``[fields, -fields]`` as int64: reduced with MAX, it carries every field's maximum and
    minimum across the ranks (the Horovod plugin's companion check encodes its fields so too)."""
    vec = np.array(fields, dtype=np.int64)
    return np.concatenate([vec, -vec])


def bounds(reduced: np.ndarray):
    """``(high, low)``: every field's maximum and minimum, from a MAX-reduced :func:`min_max_vector`."""
    n = len(reduced) // 2
    return reduced[:n], -reduced[n:]


def vector(rank: int, reject: int, fields) -> np.ndarray:
    """The vector a rank sends: ``[reject, *fields, 0]`` and its negation, slot n the rejecting
    rank; the executor fills in the last slot of each half per call."""
    vec = min_max_vector([reject, *fields, 0])
    vec[len(vec) // 2] = -rank if reject else -(1 << 62)
    return vec


def mismatch(meta_out: Optional[np.ndarray], local_error: Optional[BaseException]) -> Optional[BaseException]:
    """The error every rank raises for the MAX-reduced vector ``meta_out``, or None."""
    if meta_out is None:
        return local_error
    high, low = bounds(meta_out)
    reject_rank, reason = int(low[0]), int(high[0])
    if reason:  # some rank rejected its own arguments before the exchange
        return local_error or MismatchError(
            f"mcallreduce: rank {reject_rank} rejected the allreduce "
            f"({_REJECT_REASONS.get(reason, 'error')}); see that rank's error")
    for i, name in enumerate(FIELDS):
        if high[i + 1] != low[i + 1]:
            return MismatchError(
                f"mcallreduce: {name} differs across ranks (from {low[i + 1]} to {high[i + 1]}); "
                "every rank must pass the same element count and dtype and use the same MCALLREDUCE_* settings")
    return local_error
