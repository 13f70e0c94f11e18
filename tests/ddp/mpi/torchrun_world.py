"""Started as torchrun starts ranks (RANK, WORLD_SIZE, MASTER_ADDR in the environment, no mpirun):
each process is an MPI world of one, and every way into mcallreduce.ddp must say so clearly
instead of "averaging" each rank with itself. The exit status is the result."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mcallreduce.ddp

dist.init_process_group("gloo")
problems = []


def expect_clear_error(what: str, fn) -> None:
    try:
        fn()
    except RuntimeError as exc:
        if "without mpirun" not in str(exc):
            problems.append(f"{what}: unclear message: {exc}")
        return
    problems.append(f"{what}: did not raise")


def backward_with_default_state() -> None:
    ddp = DDP(nn.Linear(4, 2))
    ddp.register_comm_hook(None, mcallreduce.ddp.multicolor_hook)
    ddp(torch.randn(3, 4)).sum().backward()


expect_clear_error("MulticolorHookState()", mcallreduce.ddp.MulticolorHookState)
expect_clear_error("the hook with state=None, in backward()", backward_with_default_state)
expect_clear_error("new_group(backend='mcallreduce')", lambda: dist.new_group(backend="mcallreduce"))
print(f"rank {dist.get_rank()}:", "; ".join(problems) or "every way in raised clearly", flush=True)
sys.exit(1 if problems else 0)
