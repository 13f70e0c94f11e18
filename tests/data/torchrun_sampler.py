"""Started as torchrun starts ranks (RANK, WORLD_SIZE, MASTER_ADDR; no mpirun): the sampler takes
its world from torch.distributed, as DistributedSampler does. Exit status is the result."""
import sys

import torch.distributed as dist

from mcallreduce.data import InMemoryDistributedSampler

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
sampler = InMemoryDistributedSampler(range(10), seed=3)
everyone = [None] * size
dist.all_gather_object(everyone, list(sampler))
ok = (sampler.num_replicas, sampler.rank) == (size, rank) and \
    sorted(i for part in everyone for i in part) == list(range(10)) and all(len(p) == 10 // size for p in everyone)
print(f"rank {rank}:", "world from torch.distributed" if ok else f"FAILED {everyone}", flush=True)
dist.destroy_process_group()
sys.exit(0 if ok else 1)
