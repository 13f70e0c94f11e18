"""Run under mpirun -np 2 (one host): rank 0 creates a host segment and waits for rank 1 to
map it, which rank 1 never does in time. The test ends the job with SIGTERM to mpirun, as a
failing job is ended, while the segment still has its name in /dev/shm: it must not stay."""
import sys
import time

from mcallreduce.data import world as world_mod
from mcallreduce.data.shm import SharedSegment

world = world_mod.current()
if world.is_leader:
    print("creating", flush=True)
    SharedSegment(world, 64 << 20, tag="sigterm-test")
else:
    time.sleep(120)
sys.exit("the job was not ended")
