"""Persistent DataLoader workers under mpirun, on emulated hosts (MCALLREDUCE_RANKS_PER_HOST): each
epoch of a global shuffle brings samples from another host, and workers started once, by fork or by
spawn, read them and key their transforms by the epoch the rank set; the last epoch's samples leave
/dev/shm at the next set_epoch, though the idle workers still map them.

    python -m mcallreduce.launch -np 2 -- python tests/data/persistent_workers_job.py STORE fork|spawn

MPI is imported in main() only: spawned workers import this file again. Exit status is the result.
"""
import os
import sys
import zlib


class Checksum:
    """A transform of the encoded bytes: (CRC32 of what the worker read, the epoch of its key)."""
    takes_encoded = takes_key = True

    def __call__(self, data, key=None):
        return zlib.crc32(data), -1 if key is None else key[0]


def main(path, context):
    from mpi4py import MPI
    from torch.utils.data import DataLoader
    from mcallreduce.data import ImageStore, InMemoryDistributedSampler, InMemoryImageFolder, StoreFile

    store = ImageStore.open(path)
    crcs = StoreFile(path).crcs
    dataset = InMemoryImageFolder(store, Checksum())
    sampler = InMemoryDistributedSampler(dataset, shuffle_mode="global", seed=5)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context, collate_fn=list)
    failures, foreign, last = [], 0, None
    comm = MPI.COMM_WORLD
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        # the workers, idle, still map the last epoch's samples: the rank must have freed them anyway
        if last is not None and os.fstat(last).st_blocks:
            failures.append(f"rank {comm.rank} epoch {epoch}: the last epoch's samples still hold "
                            f"{os.fstat(last).st_blocks * 512} B")
        last = os.open(f"/proc/self/fd/{store._cache_segment.fd}", os.O_RDONLY)   # a look at this epoch's
        order = list(sampler)
        got = [item for batch in loader for item in batch]
        expected = [((int(crcs[i]), epoch), int(store.labels[i])) for i in order]
        wrong = [i for i, a, b in zip(order, got, expected) if a != b]
        if len(got) != len(expected) or wrong:
            failures.append(f"rank {comm.rank} epoch {epoch}: {len(got)} items for {len(expected)}, "
                            f"wrong for samples {wrong[:5]}")
        foreign += sum(not store.holds(i) for i in order)
    if store.layout.num_hosts < 2 or foreign == 0:
        failures.append(f"rank {comm.rank}: {foreign} samples from other hosts, "
                        f"{store.layout.num_hosts} hosts")
    return "\n".join(failures) or 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
