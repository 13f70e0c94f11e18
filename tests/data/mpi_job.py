"""The store under mpirun: one scenario per argv[1], on the packed store argv[2]; any number of ranks.

    python -m mcallreduce.launch -np 2 -- python -m mpi4py tests/data/mpi_job.py shared STORE

Each rank checks what it can see alone; rank 0 gathers every rank's observations and checks what
only the whole job shows. Exit status is the result: a rank that saw a failure exits non-zero,
saying which on stderr.
"""
import glob
import sys
import zlib

from mpi4py import MPI

from mcallreduce.data import (ImageStore, InMemoryDistributedSampler, InMemoryImageFolder, MemoryBudgetError,
                              StoreCorruptError, StoreFile, ThreadedLoader, TrainTransform)
from mcallreduce.data.bench_measure import memory_of_process

comm = MPI.COMM_WORLD
failures = []


def expect(condition, what):
    if not condition:
        failures.append(f"rank {comm.rank}: {what}")


def gathered(**values):
    """Every rank's ``values``, in rank order, on rank 0; None on the others."""
    return comm.gather(values, root=0)


def segments():
    return glob.glob("/dev/shm/mcallreduce-data-*")


def blob_crc_of_file(path):
    f = StoreFile(path)
    with open(path, "rb") as data:
        data.seek(f.blob_offset)
        return zlib.crc32(data.read(f.blob_bytes)), f.blob_bytes


def shared(path):
    """Ranks on one host map one copy: its bytes are the file's, each rank touched all of it, and the
    host holds it once (proportional set sizes add up to one copy)."""
    store = ImageStore.open(path)
    whole = zlib.crc32(store.blob)        # every rank touches every page of the segment
    comm.Barrier()
    mem = memory_of_process(store.segment.array.ctypes.data)
    file_crc, blob_bytes = blob_crc_of_file(path)
    size = store.segment.size
    expect(whole == file_crc, "the segment's bytes differ from the file's blob")
    expect(size >= blob_bytes, f"a segment of {size} B for a blob of {blob_bytes} B")
    expect(mem["segment_rss"] >= 0.95 * size, f"mapped {mem['segment_rss']} B of a {size} B segment")
    expect(segments() == [], f"the segment's name is still there: {segments()}")
    expect((store.layout.local_size, store.layout.num_hosts) == (comm.size, 1),
           f"layout {store.layout.local_size} ranks on {store.layout.num_hosts} hosts")
    rows = gathered(pss=mem["segment_pss"], size=size)
    if rows:
        total = sum(r["pss"] for r in rows)
        expect(total <= 1.1 * size, f"the ranks' segments add up to {total} B, more than one copy ({size} B)")


def raise_after_load(path):
    """Rank 1 fails after loading; the test checks that nothing is left in /dev/shm."""
    ImageStore.open(path)
    expect(segments() == [], f"the segment's name is still there: {segments()}")
    everyone_ok = comm.allreduce(not failures, op=MPI.LAND)
    if comm.rank == 1 and everyone_ok:
        raise RuntimeError("rank 1 fails on purpose after loading")
    comm.Barrier()   # rank 0 waits here until mpirun tears the job down


def budget(path):
    """Over the memory budget, every rank raises the same clear error and leaves no segment."""
    try:
        ImageStore.open(path)
        expect(False, "loaded a store larger than MCALLREDUCE_DATA_MEMORY_LIMIT")
    except MemoryBudgetError as exc:
        message = str(exc)
        expect(all(word in message for word in ("needs", "bytes", "MCALLREDUCE_DATA_MEMORY_LIMIT")),
               f"the error does not say what it needs or which variable to raise: {message}")
        expect(segments() == [], f"a segment left after the error: {segments()}")


def budget_on_one_host(path):
    """Over the memory budget on the first host only: the other host's ranks raise it too."""
    import os
    if comm.rank == 0:
        os.environ["MCALLREDUCE_DATA_MEMORY_LIMIT"] = "1M"
    try:
        ImageStore.open(path)
        expect(False, "a rank loaded the store although a host was over its budget")
    except MemoryBudgetError as exc:
        expect("MCALLREDUCE_DATA_MEMORY_LIMIT" in str(exc), f"not the budget's error: {exc}")
        expect(segments() == [], f"a segment left after the error: {segments()}")


def bad_setting(path):
    """A memory setting that does not parse, on every rank: every rank raises (the host's other ranks
    once waited forever for its first rank's decision)."""
    from mcallreduce.config import ConfigError
    try:
        ImageStore.open(path)
        expect(False, "opened a store with MCALLREDUCE_DATA_MEMORY_FRACTION=2")
    except ConfigError as exc:
        expect("MCALLREDUCE_DATA_MEMORY_FRACTION" in str(exc), f"not the setting's error: {exc}")


def corrupt(path):
    """A damaged blob fails on every rank with its checksum named."""
    try:
        ImageStore.open(path)
        expect(False, "loaded a store whose blob is damaged")
    except StoreCorruptError as exc:
        expect("CRC32" in str(exc), f"the error does not name the checksum: {exc}")


def exchange(path):
    """Two emulated hosts (MCALLREDUCE_RANKS_PER_HOST) split the store; the shuffles read every byte
    right, local ones never cross hosts, global ones are DistributedSampler's order, partial ones
    sit in between; an epoch decodes exchanged samples."""
    from torch.utils.data import DistributedSampler
    store = ImageStore.open(path)
    crcs = StoreFile(path).crcs
    n = len(store)
    expect(store.layout.num_hosts == 2, f"{store.layout.num_hosts} hosts")
    observed = {"held": int((store.position >= 0).sum()), "local_rank": store.layout.local_rank}
    for mode, q in (("local", 0.0), ("global", 0.0), ("partial", 0.5)):
        sampler = InMemoryDistributedSampler(store, shuffle_mode=mode, exchange_fraction=q, seed=11)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            order = list(sampler)
            key = f"{mode} epoch {epoch}"
            expect(len(order) == -(-n // comm.size), f"{key}: {len(order)} samples")
            expect(all(zlib.crc32(store.sample_bytes(i)) == crcs[i] for i in order), f"{key}: bytes differ")
            observed[key] = {"order": order, "foreign": int(sum(store.position[i] < 0 for i in order))}
            if mode == "local":
                expect(observed[key]["foreign"] == 0, f"{key}: a local shuffle read another host's samples")
            if mode == "global":
                ref = DistributedSampler(range(n), num_replicas=comm.size, rank=comm.rank, seed=11)
                ref.set_epoch(epoch)
                expect(order == list(ref), f"{key}: not DistributedSampler's order")
    dataset = InMemoryImageFolder(store, TrainTransform(seed=comm.rank))
    sampler = InMemoryDistributedSampler(dataset, shuffle_mode="global", seed=3)
    sampler.set_epoch(7)
    shapes = {tuple(x.shape[1:]) for x, _ in ThreadedLoader(dataset, 16, sampler=sampler, num_threads=2)}
    expect(shapes == {(3, 224, 224)}, f"decoded batches of shapes {shapes}")
    rows = gathered(**observed)
    if rows:
        held = sum(r["held"] for r in rows if r["local_rank"] == 0)
        expect(held == n and abs(rows[0]["held"] - n / 2) <= 1, f"the hosts hold {held} of {n}, rank 0's "
                                                                  f"{rows[0]['held']}")
        for epoch in (0, 1):
            for mode in ("local", "global", "partial"):
                key = f"{mode} epoch {epoch}"
                missed = set(range(n)) - set().union(*(r[key]["order"] for r in rows))
                expect(not missed, f"{key}: {len(missed)} samples visited by no rank")
            foreign = {mode: sum(r[f"{mode} epoch {epoch}"]["foreign"] for r in rows) for mode in ("global", "partial")}
            expect(foreign["global"] > n / 4, f"epoch {epoch}: a global shuffle brought {foreign['global']} "
                                               f"samples from the other host, expected about {n // 2}")
            expect(0 < foreign["partial"] < foreign["global"], f"epoch {epoch}: a partial shuffle brought "
                                                               f"{foreign['partial']}")


def validate(path):
    """Validation on a store split across hosts: a stock DistributedSampler is refused with the way out,
    InMemoryDistributedSampler(shuffle=False) visits every sample once, each readable on its rank."""
    from torch.utils.data import DistributedSampler
    dataset = InMemoryImageFolder(ImageStore.open(path), lambda image: image.size)
    n = len(dataset)
    try:
        for i in DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, shuffle=False):
            dataset[i]
        expect(False, "a stock DistributedSampler read every sample of a split store")
    except KeyError as exc:
        expect("stock DistributedSampler" in str(exc) and "partition='full'" in str(exc),
               f"the error does not say what to use instead: {exc}")
    order = list(InMemoryDistributedSampler(dataset, shuffle=False))
    expect(len(order) == -(-n // comm.size), f"{len(order)} samples, DistributedSampler has {-(-n // comm.size)}")
    for i in order:
        dataset[i]
    rows = gathered(order=order)
    if rows:
        visited = [i for r in rows for i in r["order"]]
        expect(set(visited) == set(range(n)), f"{n - len(set(visited))} samples visited by no rank")
        expect(len(visited) - n < comm.size, f"{len(visited) - n} samples visited twice")
    # one of num_replicas/rank under MPI: the other is MPI's, and one that disagrees with MPI is refused
    from mcallreduce.data import world as world_mod
    expect(world_mod.current(rank=comm.rank).layout.num_replicas == comm.size, "rank alone: not MPI's world")
    try:
        world_mod.current(num_replicas=comm.size + 1)
        expect(False, "a num_replicas other than MPI's world was taken")
    except ValueError as exc:
        expect("differ from MPI's world" in str(exc), f"the error does not say what differs: {exc}")
    # the global mode unshuffled is DistributedSampler's order: it brings the other host's samples too
    order = list(InMemoryDistributedSampler(dataset, shuffle=False, shuffle_mode="global"))
    ref = DistributedSampler(range(n), num_replicas=comm.size, rank=comm.rank, shuffle=False)
    expect(order == list(ref), "an unshuffled global order is not DistributedSampler's")
    for i in order:
        dataset[i]


if __name__ == "__main__":
    {"shared": shared, "raise": raise_after_load, "budget": budget, "budget_on_one_host": budget_on_one_host,
     "corrupt": corrupt, "bad_setting": bad_setting,
     "exchange": exchange, "validate": validate}[sys.argv[1]](sys.argv[2])
    sys.exit("\n".join(failures) if failures else 0)
