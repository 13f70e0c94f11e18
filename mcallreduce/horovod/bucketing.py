"""DistributedOptimizer on the fast path: gradients fused into buckets, launched in a fixed order.

Stock Horovod allreduces each gradient under its name as its hook fires and lets the
coordinator match names. We instead fuse gradients into buckets in reverse registration order
(the order backward produces them, as DDP's reducer does), each bucket one dtype and at most
MCALLREDUCE_BUCKET_BYTES. A bucket's allreduce starts as soon as all its gradients are in,
but only after every earlier bucket started, so every rank starts the same buckets in the same
order whatever order its hooks fire in: no deadlock. The communication overlaps the rest of
backward: on the engine's progress thread, or without it because every gradient hook tests the
oldest bucket in flight once. ``synchronize()`` starts what is left (parameters
without a gradient this step count as zeros, as in Horovod), waits, and copies the results back,
or with MCALLREDUCE_GRADIENT_AS_BUCKET_VIEW=1 leaves each gradient a view of its bucket, as DDP's
``gradient_as_bucket_view``: no copy back, and none in at the next step when ``zero_grad(set_to_none=False)``
lets backward accumulate into the view.

The class is built like Horovod's (``type(name, (optimizer class,), methods)``) and reuses
stock Horovod's ``__init__`` (argument checks, names), ``step``, ``zero_grad`` and
``skip_synchronize``; it replaces the hook registration and ``synchronize``.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch

from .. import config
from . import state
from .router import ROUTER, supported


class Bucket:
    """Gradients reduced by one engine allreduce, through one flat buffer reused every step."""

    def __init__(self, index: int, params: List[torch.nn.Parameter], names: List[str], wire: torch.dtype):
        self.index, self.params, self.names = index, params, names
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.flat = torch.zeros(sum(self.numels), dtype=wire)
        self.label = f"gradient bucket {index} ({names[0]}" + (f" .. {names[-1]}, {len(names)} tensors)"
                                                               if len(names) > 1 else ")")
        self.layout = ";".join(f"{n}{tuple(p.shape)}{p.dtype}" for n, p in zip(names, params))
        # slots whose gradient may stay a view of ``flat`` after synchronize (no copy back)
        self.viewable = [p.dtype == wire and p.is_contiguous() for p in params]
        self.ready = 0            # parameters whose gradients are final for this step
        self.routed = None        # the allreduce in flight
        self.sparse: Dict[int, object] = {}   # slot -> stock Horovod sparse handle


def plan_buckets(params: List[torch.nn.Parameter], names: Dict, cap: int, compressed: bool,
                 groups: Optional[List[List[torch.nn.Parameter]]] = None) -> List[Bucket]:
    """Buckets in launch order: reverse registration order, one dtype each, at most ``cap`` bytes.

    ``groups`` (Horovod's explicit groups) become buckets of their own (split by dtype); the
    remaining parameters are bucketed by size.
    """
    position = {p: i for i, p in enumerate(params)}

    def wire(p):
        return torch.float16 if compressed and p.dtype.is_floating_point else p.dtype

    runs: List[List[torch.nn.Parameter]] = []
    grouped = set()
    for group in groups or []:
        members = [p for p in group if p in position]
        grouped.update(members)
        for dtype in dict.fromkeys(wire(p) for p in members):
            runs.append([p for p in members if wire(p) == dtype])
    open_runs: Dict[torch.dtype, list] = {}   # wire dtype -> [run, bytes so far]
    for p in reversed(params):
        if p in grouped:
            continue
        nbytes = p.numel() * torch.empty(0, dtype=wire(p)).element_size()
        run = open_runs.get(wire(p))
        if run is None or (run[1] and run[1] + nbytes > cap):
            run = open_runs[wire(p)] = [[], 0]
            runs.append(run[0])
        run[0].append(p)
        run[1] += nbytes
    # launch order: the bucket holding the latest-registered parameter first
    runs.sort(key=lambda run: -max(position[p] for p in run))
    return [Bucket(i, sorted(run, key=lambda p: -position[p]),
                   [names[p] for p in sorted(run, key=lambda p: -position[p])], wire(run[0]))
            for i, run in enumerate(runs)]


class _BucketedMethods:
    """Methods that replace stock Horovod's hook and synchronize logic (see module docstring)."""

    def _register_hooks(self):
        self._build_buckets()
        for p in self._requires_update:
            p.register_post_accumulate_grad_hook(self._make_hook(p))

    def _build_buckets(self):
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._requires_update = set(params)
        groups = self._groups
        if isinstance(groups, int) and groups > 0:
            size = -(-len(params) // groups)
            groups = [params[i:i + size] for i in range(0, len(params), size)]
        compressed = self._compression is _stock.Compression.fp16
        self._buckets = plan_buckets(params, self._parameter_names, config.bucket_bytes(), compressed,
                                     groups if isinstance(groups, list) else None)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._views = config.gradient_as_bucket_view()
        self._next_bucket = self._oldest_unfinished = 0

    def _make_hook(self, p):
        def hook(_param):
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call "
                    "to step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._allreduce_delay[p] -= 1
            self._handles[p] = None   # work pending: zero_grad() now would race, as in Horovod
            if self._allreduce_delay[p] == 0:
                bucket = self._bucket_of[p]
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._launch_ready(everything=False)
            self._poll_launched()
        return hook

    def _poll_launched(self):
        """Test the oldest bucket in flight once: without the progress thread, the rounds after a
        bucket's first messages then run during the rest of backward instead of in synchronize()."""
        while self._oldest_unfinished < self._next_bucket:
            if not self._buckets[self._oldest_unfinished].routed.test():
                return
            self._oldest_unfinished += 1

    def _launch_ready(self, everything: bool):
        """Start buckets in their fixed order, stopping at the first incomplete one."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if not everything and bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket):
        for slot, (p, offset, n) in enumerate(zip(bucket.params, bucket.offsets, bucket.numels)):
            if p.grad is None:   # no gradient this step: reduce zeros, as Horovod does
                p.grad = torch.zeros_like(p)
            grad = p.grad
            if self._views and bucket.viewable[slot] and not grad.is_sparse \
                    and grad.data_ptr() == bucket.flat.data_ptr() + offset * bucket.flat.element_size():
                continue         # still the bucket's view: accumulated in place, nothing to copy
            if grad.is_sparse:
                if not self.sparse_as_dense:
                    state.warn_once("sparse gradients (use sparse_as_dense=True for the fast path)")
                    with state.stock_horovod():
                        bucket.sparse[slot] = _stock.sparse_allreduce_async(
                            grad, name=bucket.names[slot], op=self.op, process_set=self.process_set)
                    bucket.flat[offset:offset + n].zero_()
                    continue
                grad = grad.to_dense()
            bucket.flat[offset:offset + n].copy_(grad.reshape(-1))
        if self.op == _stock.Average:   # as Horovod: average split into pre- and post-scale
            kind, pre, post = "average", 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        else:
            kind, pre, post = "sum", 1.0, 1.0
        # The metadata check runs every step although the layout never changes: a rank inside
        # hvd.join() learns from it what to contribute zeros to (see join.py).
        bucket.routed = ROUTER.start(bucket.label, [bucket.flat], kind, pre, post, shapes=bucket.layout)
        state.counters["buckets"] += 1

    def synchronize(self):
        if getattr(self, "_buckets", None) is None:
            self._build_buckets()    # size 1: Horovod registers no hooks
        self._launch_ready(everything=True)
        error = None
        for bucket in self._buckets:
            try:
                bucket.routed.wait()
            except RuntimeError as exc:
                error = error or exc
                for stock_handle in bucket.sparse.values():   # or they stay in Horovod's handle map
                    _synchronize_quietly(stock_handle)
                continue
            for slot, (p, offset, n) in enumerate(zip(bucket.params, bucket.offsets, bucket.numels)):
                if slot in bucket.sparse:
                    p.grad.zero_().add_(bucket.sparse.pop(slot)())
                elif p.grad.is_sparse:
                    p.grad.zero_().add_(bucket.flat[offset:offset + n].view_as(p).to(p.dtype).to_sparse())
                elif self._views and bucket.viewable[slot]:
                    p.grad = bucket.flat[offset:offset + n].view_as(p)
                else:
                    p.grad.copy_(bucket.flat[offset:offset + n].view_as(p))
        self._reset_buckets()
        self._synchronized = True
        if error is not None:
            raise _stock.HorovodInternalError(error)

    def _reset_buckets(self):
        for bucket in getattr(self, "_buckets", None) or []:
            bucket.ready, bucket.routed = 0, None
            bucket.sparse.clear()
        self._next_bucket = self._oldest_unfinished = 0
        self._handles.clear()
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

    def load_state_dict(self, *args, **kwargs):
        self._reset_buckets()
        return _stock_optimizer_class().load_state_dict(self, *args, **kwargs)

    def set_backward_passes_per_step(self, passes):
        self.backward_passes_per_step = passes
        self._reset_buckets()


def _synchronize_quietly(stock_handle) -> None:
    try:
        stock_handle()
    except Exception:   # noqa: BLE001  (the bucket's own error is the step's)
        pass


class _StockNames:
    """horovod.torch names, looked up when first used (this module loads with horovod.torch)."""

    def __getattr__(self, name):
        return getattr(sys.modules["horovod.torch"], name)


_stock = _StockNames()


def _stock_optimizer_class():
    return sys.modules["horovod.torch.optimizer"]._DistributedOptimizer


def make_distributed_optimizer(stock_factory):
    """Our hvd.DistributedOptimizer: the bucketed optimizer, or stock Horovod's where it must."""

    def DistributedOptimizer(optimizer, named_parameters=None, compression=None,
                             backward_passes_per_step=1, op=None, gradient_predivide_factor=1.0,
                             num_groups=0, groups=None, sparse_as_dense=False, process_set=None):
        compression = _stock.Compression.none if compression is None else compression
        op = _stock.Average if op is None else op
        forced = op == state.MULTICOLOR_OP      # op=MultiColor: averaged by the plugin, always
        op = _stock.Average if forced else op
        process_set = _stock.global_process_set if process_set is None else process_set
        args = (optimizer, named_parameters, compression, backward_passes_per_step, op,
                gradient_predivide_factor, num_groups, groups, sparse_as_dense, process_set)
        why = _why_stock(optimizer, compression, op, process_set, forced)
        if why == "inactive":
            return stock_factory(*args)
        if why:
            state.warn_once(f"DistributedOptimizer with {why}")
            return _bypassing(stock_factory(*args))
        # the same argument checks as stock Horovod
        if gradient_predivide_factor != 1.0 and op != _stock.Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if num_groups != 0 and groups is None:
            groups = num_groups
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        methods = dict(_stock_optimizer_class().__dict__)
        methods.update({k: v for k, v in _BucketedMethods.__dict__.items() if not k.startswith("__")})
        cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                   gradient_predivide_factor, groups, sparse_as_dense, process_set)

    DistributedOptimizer.__doc__ = stock_factory.__doc__
    # hvd.broadcast_optimizer_state tells a DistributedOptimizer from a plain one by comparing
    # the optimizer's __module__ with this factory's (then it steps only the wrapped optimizer,
    # without allreduces, on the ranks that initialise their state): both must be Horovod's.
    DistributedOptimizer.__module__ = stock_factory.__module__
    return DistributedOptimizer


def _why_stock(optimizer, compression, op, process_set, forced: bool = False) -> Optional[str]:
    if not ROUTER.active or state.bypassed() or not (ROUTER.route_all or forced):
        return "inactive"
    if op == _stock.Adasum:
        return "op Adasum"
    if op not in (_stock.Average, _stock.Sum):
        return f"op {op}"
    if process_set is not _stock.global_process_set and process_set.process_set_id != 0:
        return "a process set other than the global one"
    if compression not in (_stock.Compression.none, _stock.Compression.fp16):
        return f"compression {getattr(compression, '__name__', compression)}"
    if compression is _stock.Compression.fp16 and torch.float16 not in ROUTER.dtypes:
        return "float16 compression under MPI's own allreduce (MPI has no float16)"
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and not supported(p.detach()):
                return f"parameters of dtype {p.dtype} on {p.device.type}"
    return None


def _bypassing(optimizer):
    """A stock DistributedOptimizer whose gradient allreduces bypass the router: stock Horovod
    matches them by name, so their hook order may differ between ranks."""
    for method in ("_allreduce_grad_async", "_grouped_allreduce_grad_async"):
        original = getattr(optimizer, method, None)
        if original is None:
            continue

        def bypass(*args, _original=original, **kwargs):
            with state.stock_horovod():
                return _original(*args, **kwargs)

        setattr(optimizer, method, bypass)
    return optimizer
