"""GPU buffers (CUDA torch tensors, CuPy arrays) under mpirun at 1-3 ranks, the ranks sharing
the host's GPUs: skipped where torch sees no CUDA device (docs/gpu.md says where they ran). The
pinned pool's rules are checked everywhere."""
import importlib.util

import numpy as np
import pytest
import torch

from _mpi import mpi_script, passed

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device")


@requires_cuda
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_cuda_tensors_reduce_bitwise_as_host_buffers(np_):
    assert f"(torch, {np_} ranks)" in passed(mpi_script(np_, "gpu_buffers.py", "torch", timeout=600))


@requires_cuda
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="CuPy is not installed")
@pytest.mark.parametrize("np_", [2])
def test_cupy_arrays_reduce_bitwise_as_host_buffers(np_):
    assert f"(cupy, {np_} ranks)" in passed(mpi_script(np_, "gpu_buffers.py", "cupy", timeout=600))


class _HostMemory:
    """The pool's allocator interface over plain host memory: the pool's rules need no GPU."""
    name = "host"

    def __init__(self):
        self.sizes = []

    def pinned(self, nbytes):
        self.sizes.append(nbytes)
        raw = np.empty(nbytes, np.uint8)
        return raw, raw


def test_the_pinned_pool_reuses_by_size_class_and_keeps_a_bounded_amount():
    from mcallreduce.gpu import _PinnedPool
    memory, pool = _HostMemory(), _PinnedPool(free_bytes=1 << 20)
    key, owner, _ = pool.take(memory, 100_000)              # the 128 KiB class
    assert key == ("host", 1 << 17) and memory.sizes == [1 << 17]
    other = pool.take(memory, 120_000)                        # in flight together: a second buffer
    pool.give(key, (owner, owner))
    assert pool.take(memory, 70_000)[1] is owner and len(memory.sizes) == 2   # reused, not pinned again
    assert pool.take(memory, 10)[0] == ("host", 1 << 16)      # the smallest class
    pool.give(key, (owner, owner))
    pool.give(other[0], other[1:])
    assert pool.free_bytes == 2 << 17
    big = [pool.take(memory, 300_000) for _ in range(5)]      # 512 KiB each
    for taken in big:
        pool.give(taken[0], taken[1:])
    assert pool.free_bytes <= 1 << 20                         # the cap, whatever the mix of sizes
    assert pool.free_bytes == (2 << 17) + (1 << 19)
