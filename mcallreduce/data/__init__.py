"""In-memory ImageNet: the training set held in the cluster's RAM (Kumar et al. 2017, part 1).

    python -m mcallreduce.data pack /data/imagenet/train imagenet-train.mcstore
    python -m mcallreduce.data bench

    from mcallreduce.data import (InMemoryImageFolder, InMemoryDistributedSampler,
                                  ThreadedLoader, TrainTransform)
    dataset = InMemoryImageFolder("imagenet-train.mcstore", TrainTransform())
    sampler = InMemoryDistributedSampler(dataset, shuffle_mode="local")
    loader = ThreadedLoader(dataset, batch_size=64, sampler=sampler, num_threads=4)

Names are imported lazily so that ``mcallreduce.data.format`` (used by the pack
worker processes) does not import torch.
"""
import importlib

_EXPORTS = {
    "pack": "format", "scan_image_folder": "format", "StoreFile": "format", "PackReport": "format",
    "StoreFormatError": "format", "CorruptImageError": "format",
    "ImageStore": "store", "MemoryBudgetError": "store", "StoreCorruptError": "store",
    "available_memory": "store",
    "InMemoryDistributedSampler": "sampler", "ResumableSampler": "resumable",
    "InMemoryImageFolder": "dataset",
    "TrainTransform": "transforms", "EvalTransform": "transforms", "decode_image": "transforms",
    "ThreadedLoader": "loader",
    "ImageFolder": "folder",
    "Layout": "world",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
