"""Horovod plugin: Horovod's allreduces through mcallreduce's multi-color engine.

Three ways in (the variables that switch each on: mcallreduce/config.py and docs/horovod.md):

* zero code change: ``MCALLREDUCE_ALGORITHM=multicolor horovodrun -np 4 python train.py``;
  the startup hook (``mcallreduce-horovod.pth``) patches ``horovod.torch`` when it is imported;
* one line: ``import mcallreduce.horovod.torch as hvd``;
* per call or per optimizer, as Adasum: ``from mcallreduce.horovod import MultiColor``, then
  ``hvd.allreduce(t, op=MultiColor)`` or ``hvd.DistributedOptimizer(opt, op=MultiColor)``
  (also ``hvd.MultiColor``); every other call stays stock Horovod. Import it on every rank
  at the same point (before or after ``hvd.init()``: after it, the import is collective).

Nothing here imports torch, Horovod or mpi4py: the startup hook loads this package in every
process where ``MCALLREDUCE_HOROVOD`` or ``MCALLREDUCE_ALGORITHM`` is set.

Its modules, in the order a call meets them: ``startup`` (the hook), ``torch`` (the one-line
import), ``patch`` (what changes in ``horovod.torch``; init and shutdown), ``mpi_lib_proxy``
(Horovod's allreduce entry points, routed or handed to stock), ``router`` (routed calls and
their handles), ``companion`` (the tensor-level metadata check beside each call), ``bucketing``
(the DistributedOptimizer's gradient buckets), ``join`` (hvd.join), ``timeline`` (a Chrome
trace of routed calls) and ``state`` (counters, warnings, the stock bypass).
"""
from .state import stats, stock_horovod

__all__ = ["stats", "stock_horovod", "is_active", "MultiColor"]


def __getattr__(name):
    if name == "MultiColor":   # imports horovod.torch and patches it for op-only routing
        from .patch import multicolor_op
        return multicolor_op()
    raise AttributeError(f"module 'mcallreduce.horovod' has no attribute {name!r}")


def is_active() -> bool:
    """True once hvd.init() has switched Horovod's allreduces over to mcallreduce."""
    import sys
    router = sys.modules.get("mcallreduce.horovod.router")
    return bool(router and router.ROUTER.active)
