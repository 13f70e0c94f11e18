"""GPU buffers (CUDA torch tensors, CuPy arrays) under mpirun at 1-3 ranks, the ranks sharing
the host's GPUs. Skipped where torch sees no CUDA device; docs/gpu.md says where they ran."""
import importlib.util

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
