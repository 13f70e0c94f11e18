"""Run by test_mpi.py under mpirun (through mcallreduce.launch): one scenario per argv[1].

Each rank prints one line 'RESULT <json>' with what it observed.
"""
import glob
import json
import sys
import zlib

from mpi4py import MPI

from mcallreduce.data import (ImageStore, InMemoryDistributedSampler, InMemoryImageFolder, MemoryBudgetError,
                              StoreCorruptError, StoreFile, ThreadedLoader, TrainTransform)
from mcallreduce.data.bench_measure import memory_of_process

comm = MPI.COMM_WORLD


def report(**values):
    print("RESULT " + json.dumps({"rank": comm.rank, **values}), flush=True)


def segments():
    return glob.glob("/dev/shm/mcallreduce-data-*")


def shared(path):
    store = ImageStore.open(path)
    whole = zlib.crc32(store.blob)        # every rank touches every page of the segment
    comm.Barrier()
    mem = memory_of_process(store.segment.array.ctypes.data)
    report(segment_bytes=store.segment.size, blob_crc=whole, file_crc=zlib.crc32(open(path, "rb").read()[
        StoreFile(path).blob_offset:StoreFile(path).blob_offset + StoreFile(path).blob_bytes]),
        segment_rss=mem["segment_rss"], segment_pss=mem["segment_pss"], names_left=segments(),
        local_size=store.layout.local_size, hosts=store.layout.num_hosts)


def raise_after_load(path):
    store = ImageStore.open(path)
    comm.Barrier()
    report(names_left=segments(), size=store.segment.size)
    if comm.rank == 1:
        raise RuntimeError("rank 1 fails on purpose after loading")
    comm.Barrier()   # rank 0 waits here until mpirun tears the job down


def budget(path):
    try:
        ImageStore.open(path)
    except MemoryBudgetError as exc:
        report(error=str(exc), names_left=segments())
        return
    report(error=None)


def corrupt(path):
    try:
        ImageStore.open(path)
    except StoreCorruptError as exc:
        report(error=str(exc))
        return
    report(error=None)


def exchange(path):
    from torch.utils.data import DistributedSampler
    store = ImageStore.open(path)
    crcs = StoreFile(path).crcs
    out = {"held": int((store.position >= 0).sum()), "total": len(store), "hosts": store.layout.num_hosts}
    for mode, q in (("local", 0.0), ("global", 0.0), ("partial", 0.5)):
        sampler = InMemoryDistributedSampler(store, shuffle_mode=mode, exchange_fraction=q, seed=11)
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            order = list(sampler)
            bad = [i for i in order if zlib.crc32(store.sample_bytes(i)) != crcs[i]]
            foreign = int(sum(store.position[i] < 0 for i in order))
            key = f"{mode}{epoch}"
            out[key] = {"n": len(order), "bad": len(bad), "foreign": foreign, "cache": store.cache_bytes,
                        "order": order}
            if mode == "global":
                ref = DistributedSampler(range(len(store)), num_replicas=comm.size, rank=comm.rank, seed=11)
                ref.set_epoch(epoch)
                out[key]["same_as_distributedsampler"] = order == list(ref)
    # An epoch through the threaded loader on exchanged samples (decode of received bytes).
    dataset = InMemoryImageFolder(store, TrainTransform(seed=comm.rank))
    sampler = InMemoryDistributedSampler(dataset, shuffle_mode="global", seed=3)
    sampler.set_epoch(7)
    shapes = {tuple(x.shape[1:]) for x, _ in ThreadedLoader(dataset, 16, sampler=sampler, num_threads=2)}
    out["loader_shapes"] = sorted(shapes)
    report(**out)


def validate(path):
    """Validation on a store split across hosts: a stock DistributedSampler is refused with the way out,
    InMemoryDistributedSampler(shuffle=False) visits every sample."""
    from torch.utils.data import DistributedSampler
    dataset = InMemoryImageFolder(ImageStore.open(path), lambda image: image.size)
    error = None
    try:
        for i in DistributedSampler(dataset, num_replicas=comm.size, rank=comm.rank, shuffle=False):
            dataset[i]
    except KeyError as exc:
        error = str(exc)
    sampler = InMemoryDistributedSampler(dataset, shuffle=False)
    order = list(sampler)
    sizes = [dataset[i][0] for i in order]    # every index is readable on this rank
    report(stock_error=error, order=order, n=len(dataset), read=len(sizes))


if __name__ == "__main__":
    {"shared": shared, "raise": raise_after_load, "budget": budget, "corrupt": corrupt,
     "exchange": exchange, "validate": validate}[sys.argv[1]](sys.argv[2])
