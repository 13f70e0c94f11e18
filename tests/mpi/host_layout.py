"""Emulated hosts (MCALLREDUCE_RANKS_PER_HOST) group the job's ranks, also seen from a communicator
whose ranks run in another order: 3 ranks, 2 per host. Every rank learns the same speed of
the "link" between them; there is none, so the links count as slow unless MCALLREDUCE_FAST_LINKS
says otherwise; a setting that differs across ranks raises on every rank.

    python -m mcallreduce.launch -np 3 -x MCALLREDUCE_RANKS_PER_HOST=2 -- python tests/mpi/host_layout.py

Exit status 0 when every rank saw the layout, and the allreduce's sum, right.
"""
import os
import sys

import numpy as np
from mpi4py import MPI

import mcallreduce
from mcallreduce import config, hostlayout, linkprobe
from mcallreduce.context import Context
from mcallreduce.config import read_ranks_per_host

world = MPI.COMM_WORLD
assert world.Get_size() == 3 and read_ranks_per_host() == 2
assert hostlayout.hosts(world, 2) == [[0, 1], [2]]
reverse = world.Split(0, -world.Get_rank())   # world ranks 2, 1, 0 as 0, 1, 2
# world 2 is host 1 alone; world 1 and 0 share host 0 (once: world 2 and 1 together, by their new ranks)
assert hostlayout.hosts(reverse, 2) == [[0], [1, 2]], hostlayout.hosts(reverse, 2)
x = np.full(5, float(world.Get_rank() + 1))
mcallreduce.allreduce(x, comm=reverse)
assert (x == 6.0).all(), x
speeds = world.allgather(linkprobe.one_way_bytes_per_s(reverse, hostlayout.hosts(reverse, 2)))
assert len(set(speeds)) == 1 and speeds[0] > 0, speeds
streams = []   # the confirming stream: where the ping-pong reads confirm_from or more, host 0's first rank to host 1's
timed = linkprobe.stream_seconds
linkprobe.stream_seconds = lambda *args: streams.append(args[1:]) or timed(*args)
linkprobe.one_way_bytes_per_s(reverse, hostlayout.hosts(reverse, 2))
assert streams == [], streams
streamed = world.allgather(linkprobe.one_way_bytes_per_s(reverse, hostlayout.hosts(reverse, 2), confirm_from=0.0))
assert len(set(streamed)) == 1 and streamed[0] > 0, streamed
seen = world.allgather(streams)   # world ranks 2 and 1 are reverse's 0 (host 0) and 1 (host 1)
assert seen[0] == [] and seen[1] == seen[2] and [s[:2] for s in seen[1]] == [(0, 1)], seen
assert linkprobe.STREAM_PIECES[0] <= seen[1][0][2] <= linkprobe.STREAM_PIECES[1], seen
linkprobe.stream_seconds = timed
assert Context.get(reverse).fast_links is False   # emulated hosts on one machine have no link between them
assert linkprobe.fast_links(reverse, [[0, 1, 2]], None) is False   # one host: no links
assert linkprobe.fast_links(reverse, hostlayout.hosts(reverse, 2), False) is False
reverse.Free()
# some ranks would probe and the others not: every rank raises instead of waiting for the probe
os.environ["MCALLREDUCE_FAST_LINKS"] = "auto" if world.Get_rank() == 0 else "1"
config.reload()
try:
    mcallreduce.allreduce(np.ones(4), comm=world.Dup())
    sys.exit(f"rank {world.Get_rank()}: a MCALLREDUCE_FAST_LINKS that differs across ranks did not raise")
except config.ConfigError as exc:
    assert "MCALLREDUCE_FAST_LINKS differs across ranks: rank 0: auto, rank 1: 1" in str(exc), exc
print(f"rank {world.Get_rank()}: layout right", flush=True)
