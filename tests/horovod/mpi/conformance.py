"""Horovod's documented allreduce semantics, run the same way with the plugin on and off.

Usage (under mpirun): conformance.py OUT.pt
Every case runs on every rank; rank 0 saves {case: tensor or error type} to OUT.pt, after
checking that all ranks got identical results. The pytest side compares the two modes.
Written for this project; it follows Horovod's API docs, not Horovod's test code.
"""
import sys
import warnings

import torch
import horovod.torch as hvd

warnings.simplefilter("ignore")   # the fallback warnings are checked elsewhere
hvd.init()
rank, size = hvd.rank(), hvd.size()
results = {}
DTYPES = [torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]


def data(shape, dtype, salt=0):
    """Deterministic, rank-dependent values; small integers so fp16 sums stay exact-ish."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


def case(name):
    def register(fn):
        try:
            out = fn()
        except Exception as exc:   # error cases record the exception type
            out = f"raised {type(exc).__name__}"
        results[name] = out
        return fn
    return register


for dtype in DTYPES:
    for dims in (1, 2, 3):
        shape = (17,) * dims
        tag = f"{str(dtype).split('.')[-1]}_{dims}d"

        @case(f"sum_{tag}")
        def _():
            return hvd.allreduce(data(shape, dtype), op=hvd.Sum, name=f"sum_{tag}")

        @case(f"average_{tag}")
        def _():
            return hvd.allreduce(data(shape, dtype, 1), op=hvd.Average)

        @case(f"scaled_{tag}")
        def _():
            return hvd.allreduce(data(shape, dtype, 2), op=hvd.Average, prescale_factor=0.5, postscale_factor=3.0)

        @case(f"inplace_{tag}")
        def _():
            t = data(shape, dtype, 3)
            out = hvd.allreduce_(t, op=hvd.Sum, prescale_factor=2.0)
            assert out.data_ptr() == t.data_ptr()
            return t


@case("out_of_place_leaves_input")
def _():
    t = data((40,), torch.float32, 4)
    before = t.clone()
    out = hvd.allreduce(t, op=hvd.Sum)
    assert torch.equal(t, before) and out.data_ptr() != t.data_ptr()
    return out


@case("fp16_compression")
def _():
    t = data((33, 5), torch.float32, 5) / 7
    out = hvd.allreduce(t, op=hvd.Average, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    return out


@case("average_legacy_flag")
def _():
    return hvd.allreduce(data((9,), torch.float64, 6), average=False)


@case("async_poll_synchronize")
def _():
    tensors = [data((1000 * (i + 1),), torch.float32, 10 + i) for i in range(4)]
    handles = [hvd.allreduce_async(t, name=f"async.{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
    handles.append(hvd.allreduce_async_(tensors[0], name="async.inplace", op=hvd.Average))
    while not all(hvd.poll(h) for h in handles):
        pass
    outs = [hvd.synchronize(h) for h in reversed(handles)]
    return torch.cat([o.reshape(-1) for o in outs])


@case("inplace_result_there_once_polled_done")
def _():
    # read before synchronize(): poll() saying done promises the result is in the tensors
    t = data((300,), torch.float32, 40)
    group = [data((6,), torch.int64, 41), data((2, 3), torch.float64, 42)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name="polled.inplace"),
               hvd.grouped_allreduce_async_(group, op=hvd.Sum, name="polled.grouped")]
    while not all(hvd.poll(h) for h in handles):
        pass
    seen = torch.cat([t.clone()] + [g.reshape(-1).double().clone() for g in group])
    for h in handles:
        hvd.synchronize(h)
    return seen


@case("poll_of_a_cleared_handle_error")
def _():
    h = hvd.allreduce_async(data((10,), torch.float32, 43), name="cleared")
    hvd.synchronize(h)
    hvd.poll(h)
    return "no error"


@case("grouped")
def _():
    ts = [data((5, 3), torch.float32, 20), data((7,), torch.float32, 21), data((2, 2), torch.float64, 22)]
    outs = hvd.grouped_allreduce(ts, op=hvd.Sum, name="grouped")
    return torch.cat([o.reshape(-1).double() for o in outs])


@case("grouped_inplace_async")
def _():
    ts = [data((6,), torch.int64, 23), data((3, 3), torch.int64, 24)]
    h = hvd.grouped_allreduce_async_(ts, op=hvd.Average, name="grouped.inplace")
    hvd.synchronize(h)
    return torch.cat([t.reshape(-1) for t in ts])


@case("autograd")
def _():
    x = data((8,), torch.float64, 25).requires_grad_()
    y = hvd.allreduce(x, op=hvd.Sum, name="autograd")
    (y * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    return torch.cat([y.detach(), x.grad])


@case("min_max_fallback")
def _():
    t = data((11,), torch.float32, 26)
    return torch.cat([hvd.allreduce(t, op=hvd.Min), hvd.allreduce(t, op=hvd.Max)])


@case("duplicate_name_error")
def _():
    a = hvd.allreduce_async(data((10,), torch.float32, 27), name="dup")
    try:
        hvd.allreduce_async(data((10,), torch.float32, 28), name="dup")
        return "no error"
    finally:
        hvd.synchronize(a)


@case("name_free_once_its_call_is_done")
def _():
    # Horovod frees a name when its call completes, synchronized or not
    a = hvd.allreduce_async(data((10,), torch.float32, 44), name="reused", op=hvd.Sum)
    while not hvd.poll(a):
        pass
    b = hvd.allreduce_async(data((10,), torch.float32, 45), name="reused", op=hvd.Sum)
    return torch.cat([hvd.synchronize(a), hvd.synchronize(b)])


@case("shape_mismatch_error")
def _():
    return hvd.allreduce(torch.ones(10 + rank), name="mismatch.count")


@case("same_count_other_shape_error")
def _():
    return hvd.allreduce(torch.ones((2, 3) if rank == 0 else (3, 2)), name="mismatch.shape")


@case("inplace_other_shape_unchanged")
def _():
    # the same element count in another shape, in place: an error on every rank, and the
    # tensor keeps its values (nothing of the other ranks' data, no prescale applied)
    t = (torch.arange(6.0) + 10 * rank).reshape((2, 3) if rank == 0 else (3, 2))
    before = t.clone()
    try:
        hvd.allreduce_(t, name="mismatch.inplace", prescale_factor=3.0)
        return f"no error; unchanged {torch.equal(t, before)}"
    except Exception as exc:
        return f"raised {type(exc).__name__}; unchanged {torch.equal(t, before)}"


@case("dtype_mismatch_error")
def _():
    return hvd.allreduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.int32), name="mismatch.dtype")


@case("after_errors_still_works")
def _():
    return hvd.allreduce(data((100,), torch.float32, 29), op=hvd.Sum)


def optimizer_case(passes=1, compression=hvd.Compression.none, op=hvd.Average, predivide=1.0, groups=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
                                torch.nn.Linear(3, 2))  # the last layer gets no gradient (unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if groups == "list":
        groups = [[model[0].weight, model[2].bias]]
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=passes, op=op,
                                   gradient_predivide_factor=predivide, groups=groups)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(passes):
            x = torch.randn(4, 6, generator=g)
            model[2](model[1](model[0](x))).pow(2).mean().backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@case("optimizer_average")
def _():
    return optimizer_case()


@case("optimizer_sum_two_passes")
def _():
    return optimizer_case(passes=2, op=hvd.Sum)


@case("optimizer_fp16_predivide")
def _():
    return optimizer_case(compression=hvd.Compression.fp16, predivide=2.0)


@case("optimizer_groups")
def _():
    return torch.cat([optimizer_case(groups=2), optimizer_case(groups="list")])


@case("resume_broadcast_optimizer_state")
def _():
    # Horovod's resume pattern: rank 0 restores a trained optimizer's state, the others start
    # fresh, then broadcast_parameters + broadcast_optimizer_state (the fresh ranks initialise
    # their state with a step of the wrapped optimizer only: no allreduce, or rank 0 waits)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(4, 5)).pow(2).sum().backward()
    opt.step()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.manual_seed(1)
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    if rank == 0:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()["state"]
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]
                     + [state[k]["exp_avg"].reshape(-1) for k in sorted(state)])


@case("optimizer_zero_grad_before_step_error")
def _():
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    model(torch.ones(2, 3)).sum().backward()
    try:
        opt.zero_grad()
        return "no error"
    except AssertionError:
        return "raised AssertionError"
    finally:
        model(torch.ones(2, 3)).sum().backward()
        opt.step()


# Every rank must have computed the same thing.
mine = {k: (v if isinstance(v, str) else v.contiguous()) for k, v in results.items()}
everyone = hvd.allgather_object(mine)
if rank == 0:
    differing = [k for k in mine if any(
        (isinstance(v, str) or isinstance(other[k], str)) and v != other[k]
        or not isinstance(v, str) and not torch.equal(v, other[k]) for other in everyone for v in [mine[k]])]
    torch.save({"results": mine, "differing_across_ranks": differing, "size": size}, sys.argv[1])
    print(f"CONFORMANCE {len(mine)} cases, {len(differing)} differing across ranks", flush=True)
