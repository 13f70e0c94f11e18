"""Patching ``horovod.torch`` (after it was imported) and switching the router on at hvd.init().

What changes in the module: ``mpi_ops.mpi_lib`` becomes the routing proxy, ``init`` activates
the plugin after stock init, ``shutdown`` deactivates it first, ``DistributedOptimizer``
becomes the bucketed one. Before ``hvd.init()`` and whenever activation declines (Gloo
controller, elastic mode, a sub-communicator), every call goes to stock Horovod unchanged.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import warnings

import torch

from .. import config, policy
from ..launch import launched_by_mpirun
from . import state, timeline
from .bucketing import make_distributed_optimizer
from .router import ROUTER, SUPPORTED_DTYPES
from .mpi_lib_proxy import MpiLibProxy


def patch_horovod_torch(hvd, route_all: bool = True) -> None:
    """Patch the imported ``horovod.torch`` package (idempotent). ``route_all=False``: only
    calls with ``op=MultiColor`` are routed (``from mcallreduce.horovod import MultiColor``)."""
    ROUTER.route_all = ROUTER.route_all or route_all
    hvd.MultiColor = state.MULTICOLOR_OP
    if getattr(hvd, "_mcallreduce_patched", False):
        return
    mpi_ops = sys.modules["horovod.torch.mpi_ops"]
    optimizer_module = sys.modules["horovod.torch.optimizer"]
    ops = {name: getattr(mpi_ops, name) for name in ("Average", "Sum", "Adasum", "Min", "Max", "Product")}
    mpi_ops.mpi_lib = MpiLibProxy(mpi_ops.mpi_lib, ops)

    stock_init, stock_shutdown = mpi_ops.init, mpi_ops.shutdown

    @functools.wraps(stock_init)
    def init(*args, **kwargs):
        if not hvd.is_initialized():   # a second init keeps the MPI (and its owner) of the first
            state.mpi_outlives_horovod = _initialize_mpi_first()
        stock_init(*args, **kwargs)
        _activate(hvd, kwargs.get("comm", args[0] if args else None))

    @functools.wraps(stock_shutdown)
    def shutdown(*args, **kwargs):
        _stop_progress()   # before Horovod finalizes MPI
        return stock_shutdown(*args, **kwargs)

    optimizer = make_distributed_optimizer(optimizer_module.DistributedOptimizer)
    for module in (hvd, mpi_ops):
        module.init, module.shutdown = init, shutdown
    hvd.DistributedOptimizer = optimizer_module.DistributedOptimizer = optimizer
    hvd._mcallreduce_patched = True


def multicolor_op() -> int:
    """``MultiColor``: patch horovod.torch for it (once) and return the op constant. After
    hvd.init() this activates the router at once, which is collective."""
    import horovod.torch as hvd
    if not getattr(hvd, "_MPI_LIB_AVAILABLE", False):
        raise ImportError("mcallreduce: MultiColor needs Horovod built with its PyTorch extension")
    first = not getattr(hvd, "_mcallreduce_patched", False)
    patch_horovod_torch(hvd, route_all=False)
    if first and hvd.is_initialized() and not ROUTER.active:
        _activate(hvd, None)
    return state.MULTICOLOR_OP


def _initialize_mpi_first() -> bool:
    """Initialise MPI through mpi4py before Horovod can, wherever the plugin may run, and say
    whether mpi4py owns it. Horovod then never finalizes MPI (it finalizes only an MPI it
    initialised); mpi4py does at exit, after every thread is done. Otherwise one rank's Horovod
    shutdown makes every rank's Horovod thread finalize MPI, and the ranks must meet before it,
    which a rank inside a stock Horovod call never does (docs/horovod.md)."""
    if "mpi4py.MPI" not in sys.modules:
        gloo = (os.environ.get("HOROVOD_CONTROLLER", "").lower() == "gloo"
                or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ)
        if (not launched_by_mpirun() or gloo or os.environ.get("HOROVOD_ELASTIC") == "1"
                or config.horovod_mpi_threads_disabled()):
            return False   # stock Horovod's own MPI start-up (the plugin declines or explains why)
        from mpi4py import MPI   # noqa: F401  (initialises MPI, MPI_THREAD_MULTIPLE)
    mpi = sys.modules["mpi4py.MPI"]
    return bool(mpi.Is_initialized() and not mpi.Is_finalized())


def _decline(feature: str) -> None:
    warnings.warn(f"mcallreduce: {feature} is not supported by the multi-color fast path; "
                  "this job runs stock Horovod", RuntimeWarning, stacklevel=3)


def _activate(hvd, comm_arg) -> None:
    """After stock hvd.init(): route allreduces through mcallreduce, or say why not."""
    if ROUTER.active:   # a second hvd.init(), which stock Horovod ignores too
        return
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        return _decline("elastic mode")
    # gloo_enabled() is also true under the MPI controller with HOROVOD_CPU_OPERATIONS=gloo;
    # only the Gloo controller (horovodrun --gloo) runs without MPI, which the engine needs
    if not hvd.mpi_enabled():
        return _decline("the Gloo controller (horovodrun --gloo)")
    from mpi4py import MPI   # MPI is initialised by Horovod at this point: mpi4py adopts it

    world = MPI.COMM_WORLD
    if comm_arg is None:
        comm = None
    elif isinstance(comm_arg, MPI.Comm):
        comm = None if MPI.Comm.Compare(comm_arg, world) in (MPI.IDENT, MPI.CONGRUENT) else comm_arg
    elif list(comm_arg) == list(range(world.Get_size())):
        comm = None
    else:
        return _decline("hvd.init(comm=<a subset of ranks>)")
    ours = world if comm is None else comm
    if ours.Get_size() != hvd.size() or ours.Get_rank() != hvd.rank():
        return _decline("a communicator that does not match Horovod's ranks")
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE or not hvd.mpi_threads_supported():
        raise RuntimeError(
            "mcallreduce: the Horovod plugin needs MPI_THREAD_MULTIPLE (its progress thread calls MPI "
            f"next to Horovod's), but this MPI provides thread level {MPI.Query_thread()}. Unset "
            "HOROVOD_MPI_THREADS_DISABLE or use an MPI built with thread support, or unset the "
            "MCALLREDUCE_* variables (or set MCALLREDUCE_HOROVOD=0) to run stock Horovod.")
    import mcallreduce
    from mcallreduce import runtime

    settings = config.current()              # a bad MCALLREDUCE_* value raises here, clearly
    config.bucket_bytes()
    ctx = runtime.Context.get(comm)          # collective: every rank is inside hvd.init()
    if policy.progress_thread(ctx.hosts):
        runtime.start_progress_thread(comm)
    atexit.register(_stop_progress)   # runs before Horovod's atexit shutdown (registered earlier)
    ROUTER.comm = comm
    # MPI has no float16: under MCALLREDUCE_ALGORITHM=mpi or mpi-ring, Horovod's own path reduces it
    ROUTER.dtypes = SUPPORTED_DTYPES - {torch.float16} if settings.algorithm in config.MPI_ALGORITHMS else SUPPORTED_DTYPES
    path = timeline.path_for(ctx.rank)
    if path is None or ROUTER.timeline is None or ROUTER.timeline.path != path:   # hvd.init() after shutdown appends
        ROUTER.timeline = timeline.Timeline(path, ctx.rank) if path else None
    ROUTER.active = True
    if ctx.rank == 0:
        colors = settings.colors if settings.colors is not None else "auto"
        print(f"mcallreduce {mcallreduce.__version__}: {settings.algorithm} allreduce active "
              f"(ranks={ctx.size}, hosts={len(ctx.hosts)}, colors={colors})", file=sys.stderr, flush=True)


def _stop_progress() -> None:
    """Stop routing and the engine's progress thread, then let Horovod shut down.

    Where mpi4py owns MPI (:func:`_initialize_mpi_first`) this is all local: MPI outlives
    Horovod's thread, and MPI_Finalize frees the one-host window at exit. Where Horovod owns
    it, one rank's Horovod shutdown makes every rank's Horovod thread finalize MPI, whatever
    else that process is doing, and MPI must not be finalized under a running progress
    thread, an open shared-memory window or a call of ours still returning: so every rank
    stops both, then the ranks meet in Horovod's own barrier, which Horovod's thread runs
    before it can finalize, while this thread waits outside MPI (docs/horovod.md).
    """
    if not ROUTER.active:
        return
    ROUTER.active = False
    ROUTER.forget_handles()   # as stock's shutdown clears its handles: poll and synchronize raise ValueError
    if ROUTER.timeline is not None:
        ROUTER.timeline.write()
    from mcallreduce import runtime
    ctx = runtime.Context.get(ROUTER.comm)
    # stops the progress thread and says goodbye: a peer still waiting on a routed call that
    # this rank never started fails (HorovodInternalError) instead of waiting forever
    ctx.close()
    if state.mpi_outlives_horovod:
        if ctx.shared is not None:
            ctx.shared.leave_to_finalize()
        ctx.release()   # no collective left in it: the window stays for MPI_Finalize
        return
    # before the barrier: MPI_Finalize frees a window still open with a barrier that a rank
    # which already exited never joins
    ctx.release()   # collective: every rank is here (the window, the engine)
    # Not an MPI barrier of ours: a rank could still be returning from it when a faster peer's
    # shutdown makes this rank's Horovod thread finalize MPI (a segfault at exit).
    sys.modules["horovod.torch"].barrier()
