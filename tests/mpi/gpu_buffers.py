"""GPU buffers: each rank's allreduce of CUDA torch tensors (and CuPy arrays, where CuPy is
installed) is bitwise the result the same call gives on a host buffer, for every dtype, op
and algorithm; ``out=``, async handles and done-callbacks see the result on the GPU, with and
without the progress thread; the copy back does not wait for work queued on the default stream
after the call; a GPU buffer that cannot be reduced, or whose staging fails on one rank, raises
on every rank.

    python -m mcallreduce.launch -np 2 -- python tests/mpi/gpu_buffers.py torch|cupy

Ranks of one host share its GPUs round-robin. The exit status is the result.
"""
import sys
import time
import traceback

import numpy as np
import torch
from mpi4py import MPI

import mcallreduce
from mcallreduce import MismatchError, runtime

LIB = sys.argv[1] if len(sys.argv) > 1 else "torch"
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
DEVICE = local.Get_rank() % torch.cuda.device_count()
torch.cuda.set_device(DEVICE)
DEV = torch.device("cuda", DEVICE)
if LIB == "cupy":
    import cupy
    cupy.cuda.Device(DEVICE).use()

DTYPES = ("float16", "float32", "float64", "int32", "int64")
OPS = ("sum", "average", "min", "max", "product")
ALGORITHMS = ("multicolor", "ring", "mpi")
COUNTS = (0, 1, 1000, 300_001)   # up to 1.2 MB of float32: several segments, colors and pieces


def host_data(n: int, dtype: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype.startswith("int"):
        return rng.integers(-3, 4, n).astype(dtype)   # products stay small
    return (rng.standard_normal(n) * (0.5 if dtype == "float16" else 1.0)).astype(dtype)


def to_gpu(arr: np.ndarray):
    if LIB == "cupy":
        return cupy.asarray(arr)
    return torch.from_numpy(arr.copy()).cuda()


def to_host(buf) -> np.ndarray:
    return cupy.asnumpy(buf) if LIB == "cupy" else buf.cpu().numpy()


failures = []


def check(ok: bool, what: str) -> None:
    if not ok:
        failures.append(what)


def every_dtype_op_and_algorithm() -> None:
    seed = 0
    for algorithm in ALGORITHMS:
        for dtype in DTYPES:
            for op in OPS:
                for n in COUNTS:
                    seed += 1
                    data = host_data(n, dtype, seed)
                    buf = to_gpu(data)
                    try:
                        want = mcallreduce.allreduce(data.copy(), op=op, algorithm=algorithm)
                    except (TypeError, ValueError) as exc:   # what a host buffer cannot do, a GPU one cannot
                        raises_everywhere(lambda: mcallreduce.allreduce(buf, op=op, algorithm=algorithm),
                                          type(exc), f"{algorithm} {dtype} {op}")
                        continue
                    got = mcallreduce.allreduce(buf, op=op, algorithm=algorithm)
                    check(got is buf, f"{algorithm} {dtype} {op} n={n}: the result is not the buffer passed in")
                    check(np.array_equal(to_host(buf).view(np.uint8), want.view(np.uint8)),
                          f"{algorithm} {dtype} {op} n={n}: GPU result differs from the host result")


def out_leaves_the_input_alone() -> None:
    data = host_data(5000, "float32", 7)
    buf, out = to_gpu(data), to_gpu(np.zeros_like(data))
    got = mcallreduce.allreduce(buf, out=out, op="sum")
    check(got is out, "out=: the result is not out")
    check(np.array_equal(to_host(buf), data), "out=: the input changed")
    check(np.array_equal(to_host(out), mcallreduce.allreduce(data.copy(), op="sum")), "out=: wrong result")


def a_parameter_that_requires_grad() -> None:
    """As on the host (as Horovod's broadcast_parameters and allreduce_ do): written in place."""
    if LIB != "torch":
        return
    weight = torch.nn.Parameter(torch.full((10,), float(rank + 1), device=DEV))
    mcallreduce.allreduce(weight)
    check(torch.equal(weight.detach().cpu(), torch.full((10,), size * (size + 1) / 2)), "parameter: wrong result")
    check(weight.requires_grad and weight.grad_fn is None, "parameter: no longer a leaf that requires grad")


def many_in_flight_with_callbacks() -> None:
    """Buckets of one size in flight together (each needs its own pinned buffer), finished in any
    order; every callback already sees its result on the GPU."""
    datas = [host_data(65536 + (i % 2), "float32", 100 + i) for i in range(6)]
    # async on the host too: where the policy picks MPI's own allreduce, its nonblocking
    # algorithm may sum in another order than the blocking one
    wants = [h.wait() for h in [mcallreduce.allreduce_async(d.copy(), op="average") for d in datas]]
    bufs = [to_gpu(d) for d in datas]
    seen = {}
    handles = []
    for i, buf in enumerate(bufs):
        h = mcallreduce.allreduce_async(buf, op="average")
        h.add_done_callback(lambda h, i=i: seen.__setitem__(i, to_host(bufs[i]).copy()))
        handles.append(h)
    for h in reversed(handles):
        check(h.wait() is bufs[handles.index(h)], "async: wait() did not return the GPU buffer")
    deadline = time.monotonic() + 30   # a progress thread may still be running the last callbacks
    while len(seen) < len(bufs) and time.monotonic() < deadline:
        time.sleep(0.01)
    for i, want in enumerate(wants):
        check(i in seen and np.array_equal(seen[i], want), f"async bucket {i}: the callback saw another result")
        check(np.array_equal(to_host(bufs[i]), want), f"async bucket {i}: wrong result")


def the_copy_back_does_not_wait_for_the_callers_later_work() -> None:
    """Work queued on the default stream after the call started (the rest of a backward pass)
    does not hold up the result: wait() returns while that work still runs. Checked on rank 0,
    whose peers join the call only once its work is queued (with one rank, nothing holds the
    call back)."""
    if size == 1:
        return
    data = host_data(100_000, "float32", 13)
    want = mcallreduce.allreduce(data.copy())
    buf = to_gpu(data)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10 ** 7)
    torch.cuda.synchronize()
    cycles_per_s = 10 ** 7 / (time.perf_counter() - t0)
    if rank == 0:
        handle = mcallreduce.allreduce_async(buf)
        torch.cuda._sleep(int(3 * cycles_per_s))   # about 3 s on the legacy default stream, which CuPy shares
        comm.Barrier()
        handle.wait()
        check(not torch.cuda.default_stream().query(), "copy back: wait() returned only after later work")
    else:
        comm.Barrier()
        mcallreduce.allreduce(buf)
    check(np.array_equal(to_host(buf), want), "copy back past the default stream: wrong result")
    comm.Barrier()


def raises_everywhere(fn, local_exc, what: str) -> None:
    try:
        fn()
    except (local_exc, MismatchError):
        return
    except Exception as exc:   # noqa: BLE001
        failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
        return
    failures.append(f"{what}: did not raise")


def bad_buffers_raise_on_every_rank() -> None:
    if LIB == "torch":
        good = torch.zeros(64, 2, device=DEV)
        bad = good.t() if rank == 0 else good            # not contiguous on rank 0 only
        raises_everywhere(lambda: mcallreduce.allreduce(bad), ValueError, "non-contiguous on rank 0")
        bf16 = torch.zeros(16, dtype=torch.bfloat16, device=DEV)
        raises_everywhere(lambda: mcallreduce.allreduce(bf16), TypeError, "bfloat16 GPU tensor")
        host_out = np.zeros(16, np.float32)
        raises_everywhere(lambda: mcallreduce.allreduce(torch.zeros(16, device=DEV), out=host_out), ValueError,
                          "GPU buffer with a host out")
    else:
        good = cupy.zeros((64, 2), np.float32)
        bad = good.T if rank == 0 else good
        raises_everywhere(lambda: mcallreduce.allreduce(bad), ValueError, "non-contiguous on rank 0")
    # and the library still works afterwards
    data = host_data(100, "float32", 9)
    check(np.array_equal(to_host(mcallreduce.allreduce(to_gpu(data))), mcallreduce.allreduce(data.copy())),
          "after the errors: wrong result")


def a_failed_staging_on_one_rank_raises_everywhere() -> None:
    """No pinned memory left on rank 0 (injected): rank 0 raises StagingError, the others MismatchError."""
    from mcallreduce import gpu

    def exhausted(*args):
        raise RuntimeError("out of pinned memory (injected)")

    if rank == 0:
        gpu._POOL.take = exhausted
    try:
        raises_everywhere(lambda: mcallreduce.allreduce(to_gpu(np.ones(1000, np.float32))), gpu.StagingError,
                          "no pinned memory on rank 0")
    finally:
        gpu._POOL.__dict__.pop("take", None)
    data = host_data(100, "float32", 11)
    check(np.array_equal(to_host(mcallreduce.allreduce(to_gpu(data))), mcallreduce.allreduce(data.copy())),
          "after a failed staging: wrong result")


for name, fn in [("every_dtype_op_and_algorithm", every_dtype_op_and_algorithm),
                 ("out_leaves_the_input_alone", out_leaves_the_input_alone),
                 ("a_parameter_that_requires_grad", a_parameter_that_requires_grad),
                 ("many_in_flight_with_callbacks", many_in_flight_with_callbacks),
                 ("bad_buffers_raise_on_every_rank", bad_buffers_raise_on_every_rank),
                 ("a_failed_staging_on_one_rank_raises_everywhere", a_failed_staging_on_one_rank_raises_everywhere),
                 ("many_in_flight_on_the_progress_thread", many_in_flight_with_callbacks),
                 ("the_copy_back_does_not_wait_for_the_callers_later_work",
                  the_copy_back_does_not_wait_for_the_callers_later_work)]:
    if name == "many_in_flight_on_the_progress_thread":
        runtime.start_progress_thread()
    before = len(failures)
    try:
        fn()
    except Exception:   # noqa: BLE001
        failures.append(f"{name}: {traceback.format_exc()}")
    if rank == 0:
        print(f"{'ok' if len(failures) == before else 'FAILED'} {name} ({LIB}, {size} ranks)", flush=True)

everyone = [f for fs in comm.allgather([f"rank {rank}: {f}" for f in failures]) for f in fs]
if rank == 0 and everyone:
    print("\n".join(everyone[:40]), file=sys.stderr, flush=True)
sys.exit(1 if everyone else 0)
