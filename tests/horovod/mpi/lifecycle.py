"""hvd.init() twice, and a handle still in flight at hvd.shutdown(): as stock Horovod does.

    mpirun -np N python lifecycle.py stock|plugin

A second hvd.init() changes nothing. After hvd.shutdown(), poll and synchronize of a handle
started before it raise ValueError (the handle was cleared). With the plugin, hvd.init()
after hvd.shutdown() routes again, and the same name is free (stock Horovod cannot start
twice). The test reads the timeline the plugin writes.
"""
import sys
import time

import torch
import horovod.torch as hvd

hvd.init()
assert torch.equal(hvd.allreduce(torch.ones(4), name="first"), torch.ones(4))
hvd.init()
assert torch.equal(hvd.allreduce(torch.ones(4), name="second"), torch.ones(4))
handle = hvd.allreduce_async(torch.ones(4), name="pending")
while not hvd.poll(handle):   # finished, not synchronized: stock clears it at shutdown
    time.sleep(0.01)
hvd.shutdown()
for call in (hvd.poll, hvd.synchronize):
    try:
        call(handle)
        sys.exit(f"{call.__name__} of a handle from before hvd.shutdown() returned")
    except ValueError as exc:
        assert "cleared" in str(exc), exc
if sys.argv[1] == "plugin":
    hvd.init()
    assert torch.equal(hvd.allreduce(torch.ones(4), name="pending"), torch.ones(4))
    assert torch.equal(hvd.allreduce(torch.ones(4), name="third"), torch.ones(4))
    hvd.shutdown()
print("LIFECYCLE OK", flush=True)
