"""The public API where a user strays from the common call: each case ends on every rank,
with the right sum or the same error, instead of a wrong result or a wait that never ends.

    python -m mcallreduce.launch -np 2 -- python tests/mpi/api_edges.py CASE

CASE is one of the functions below. A call that has not returned within 10 s fails the job.
Exit status 0 when the case held on every rank.
"""
import gc
import io
import logging
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce.runtime import Context, start_progress_thread

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def within(seconds, fn):
    """fn()'s result, or its exception; SystemExit when it has not returned by then."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as exc:   # noqa: BLE001
            out["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        sys.exit(f"rank {rank}: still waiting after {seconds} s")
    return out.get("error", out.get("value"))


def freed_communicator():
    # MPI gives a freed communicator's handle to the next one: it must not find the old context
    pair = world.Split(0, rank)
    x = np.ones(4, np.float32)
    mcallreduce.allreduce(x, comm=pair)
    assert x[0] == size
    handle = pair.py2f()
    pair.Free()
    alone = world.Split(rank, 0)
    assert alone.py2f() == handle, "MPI did not reuse the handle: the case tests nothing"
    y = np.ones(4, np.float32)
    mcallreduce.allreduce(y, comm=alone)
    assert y[0] == 1.0, (y, handle, alone.py2f())
    # a context closed (hvd.shutdown() with this communicator), then the communicator used again
    Context.get(alone).close()
    mcallreduce.allreduce(y, comm=alone)
    assert Context.get(alone) is Context.get(alone), "each call made a new context"


def foreign_byte_order():
    # a big-endian float32 after a native one of the same size, which the fast path remembers
    mcallreduce.allreduce(np.ones(4, np.float32))
    error = within(10, lambda: mcallreduce.allreduce(np.ones(4, ">f4")))
    assert isinstance(error, TypeError) and ">f4" in str(error), error


def raising_callback():
    # a done callback that raises is logged; the engine goes on reporting the other calls
    logged = io.StringIO()
    logging.getLogger("mcallreduce").addHandler(logging.StreamHandler(logged))
    if sys.argv[2:] == ["thread"]:
        start_progress_thread()
    a, b = np.ones(4, np.float32), np.ones(4, np.float32)
    first, second = mcallreduce.allreduce_async(a), mcallreduce.allreduce_async(b)
    first.add_done_callback(lambda handle: 1 / 0)
    assert within(10, second.wait) is b and within(10, first.wait) is a and a[0] == b[0] == size
    assert "ZeroDivisionError" in logged.getvalue(), logged.getvalue()
    after = within(10, lambda: mcallreduce.allreduce(np.ones(4, np.float32)))
    assert isinstance(after, np.ndarray) and after[0] == size, after


def option_on_one_rank():
    # an unknown option, or an invalid value, on one rank: every rank raises
    for bad in ({"colour": 2}, {"route": "bogus"}):
        error = within(10, lambda: mcallreduce.allreduce(np.ones(8, np.float32), **(bad if rank == 0 else {})))
        assert isinstance(error, ValueError), (bad, error)   # ConfigError on rank 0, MismatchError elsewhere
        if rank == 0:
            assert list(bad)[0] in str(error), error


def lazy_tensor_view_on_one_rank():
    # a negated view failed in torch's numpy() with RuntimeError on that rank alone, whose next
    # call then paired with its peers' first
    import torch
    tensor = torch.ones(4)._neg_view() if rank == 0 else torch.ones(4)
    error = within(10, lambda: mcallreduce.allreduce(tensor))
    assert isinstance(error, (TypeError, ValueError)), error
    assert rank != 0 or "negated" in str(error), error
    after = within(10, lambda: mcallreduce.allreduce(torch.full((4,), 10.0)))
    assert not isinstance(after, Exception) and after[0] == 10 * size, after


def intercommunicator():
    # MPI_Comm_split_type on an intercommunicator crashed every rank (SIGSEGV); COMM_NULL: no group at all
    local = world.Split(rank % 2, rank)
    inter = local.Create_intercomm(0, world, 1 - rank % 2)
    error = within(10, lambda: mcallreduce.allreduce(np.ones(4), comm=inter))
    assert isinstance(error, TypeError) and "intercommunicator" in str(error), error
    inter.Free()
    local.Free()
    error = within(10, lambda: mcallreduce.allreduce(np.ones(4), comm=MPI.COMM_NULL))   # once a bare MPI error
    assert isinstance(error, ValueError) and "COMM_NULL" in str(error), error


def every_tag_window_in_flight():
    # one call more than there are tag windows: the last waits for the first instead of failing on one rank
    windows = Context.get().windows
    if rank == 0:
        time.sleep(1)   # the other rank reaches the limit first
    buffers = [np.ones(4, np.float32) for _ in range(windows + 1)]
    handles = [mcallreduce.allreduce_async(b) for b in buffers]
    waited = within(30, lambda: [h.wait() for h in handles])
    assert isinstance(waited, list) and all(b[0] == size for b in buffers), waited


def closed_with_a_call_in_flight():
    # hvd.shutdown() with a handle not waited for: it fails here as it does at the peers
    handle = mcallreduce.allreduce_async(np.ones(1 << 12, np.float32), algorithm="ring")
    if rank == 0:
        Context.get().close()
    error = within(10, handle.wait)
    assert isinstance(error, RuntimeError), error
    assert ("closed" if rank == 0 else "shut down") in str(error), error


def abort_while_idle():
    # the stall limit's abort, when its call finished just before it: no later call fails
    mcallreduce.allreduce(np.ones(4, np.float32))
    if rank == 0:
        Context.get().engine.fail_all("the call waited longer than the stall shutdown time")
    x = np.ones(4, np.float32)
    result = within(10, lambda: mcallreduce.allreduce(x))
    assert result is x and x[0] == size, result


def progress_thread_started_under_calls():
    # another thread's calls go on while the progress thread starts
    errors, calls = [], [0]

    def submit():
        try:
            for _ in range(2000):
                mcallreduce.allreduce_async(np.ones(4, np.float32)).wait()
                calls[0] += 1
        except Exception as exc:   # noqa: BLE001
            errors.append(exc)
    thread = threading.Thread(target=submit, daemon=True)
    thread.start()
    time.sleep(0.05)
    start_progress_thread()
    thread.join(30)
    assert not thread.is_alive() and not errors and calls[0] == 2000, (errors, calls)


def stall_report_to_a_stderr_without_a_file():
    # a notebook's or a logger's stderr has no file descriptor; the stall limit still fails the call
    # (run with MCALLREDUCE_STALL_CHECK_TIME_SECONDS=1, MCALLREDUCE_STALL_SHUTDOWN_TIME_SECONDS=2)
    class Relay(io.TextIOBase):
        def write(self, text):
            return sys.__stderr__.write(text)
    mcallreduce.allreduce(np.ones(4, np.float32))   # the context, made collectively
    sys.stderr = Relay()
    if rank == 0:
        error = within(10, lambda: mcallreduce.allreduce(np.ones(4, np.float32)))
        assert isinstance(error, RuntimeError) and "stall shutdown time" in str(error), error
    else:
        time.sleep(4)   # never starts the call


def freed_communicators_release_their_contexts():
    # a job that makes and frees communicators (process sets, groups) keeps no engine, thread,
    # window or scratch buffer per freed one; freeing is collective, so the release may be too
    def live():
        gc.collect()
        return sum(type(o) is Context for o in gc.get_objects())

    def windows():
        with open("/proc/self/maps") as maps:
            return sum("/osc_sm." in line for line in maps)
    before, threads, mapped = live(), threading.active_count(), windows()
    for k in range(6):
        sub = world.Dup()
        if k % 2:
            start_progress_thread(sub)
        x = np.ones(1 << 14, np.float32)
        mcallreduce.allreduce(x, comm=sub)
        handle = mcallreduce.allreduce_async(x, comm=sub, algorithm="ring")
        assert np.all(handle.wait() == size * size), x[:4]
        del handle
        sub.Free()
    # freed with a call still in flight (never waited for): the call fails, and the release still
    # frees the window on every rank, so no rank waits in MPI_Win_free for one that could not
    sub = world.Dup()
    handle = mcallreduce.allreduce_async(np.ones(1 << 14, np.float32), comm=sub)
    within(10, sub.Free)
    outcome = within(10, handle.wait)
    assert isinstance(outcome, np.ndarray) and outcome[0] == size or \
        isinstance(outcome, RuntimeError) and "closed" in str(outcome), outcome
    del handle, outcome
    assert live() == before, f"{live() - before} contexts of freed communicators are alive"
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
    assert windows() == mapped, f"{windows() - mapped} shared-memory windows of freed communicators are mapped"


def after_finalize():
    mcallreduce.allreduce(np.ones(4, np.float32))
    MPI.Finalize()
    error = within(10, lambda: mcallreduce.allreduce(np.ones(4, np.float32)))
    assert isinstance(error, RuntimeError) and "MPI_Finalize" in str(error), error


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    if not MPI.Is_finalized():
        world.Barrier()
    print(f"rank {rank}: {sys.argv[1]} held", flush=True)
