"""Dataset, transforms and loaders over the in-memory store (single process)."""
import math
import os
import pickle
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from data_helpers import imagefolder_order
from mcallreduce.data import (EvalTransform, ImageStore, InMemoryDistributedSampler, InMemoryImageFolder,
                              StoreFile, ThreadedLoader, TrainTransform)
from mcallreduce.data.transforms import _scale_for, decode_region, image_size


@pytest.fixture(scope="module")
def store(packed):
    return ImageStore.open(packed[0], num_replicas=1, rank=0)


def test_items_are_imagefolder_pairs(store, packed, photo_tree):
    root, _ = photo_tree
    paths = StoreFile(packed[0]).paths
    dataset = InMemoryImageFolder(store)
    assert dataset.classes == store.classes and dataset.class_to_idx["astronaut"] == 0
    assert isinstance(dataset.targets, np.ndarray)
    for i in (0, 9, 40, 150, 299):       # 9 is a PNG, 40 a greyscale JPEG (camera)
        image, label = dataset[i]
        with Image.open(os.path.join(root, paths[i])) as expected:
            assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(expected.convert("RGB")))
        assert label == int(dataset.targets[i]) == dataset.class_to_idx[paths[i].split(os.sep)[0]]
    with pytest.raises(IndexError):
        dataset[len(dataset) + 5]


def test_loading_straight_from_a_folder(clean_tree):
    dataset = InMemoryImageFolder(clean_tree, num_replicas=1, rank=0)
    classes, samples = imagefolder_order(clean_tree)
    assert dataset.classes == classes and len(dataset) == len(samples)
    for i in (0, len(samples) // 2, len(samples) - 1):
        image, label = dataset[i]
        with Image.open(samples[i][0]) as expected:
            assert np.array_equal(np.asarray(image), np.asarray(expected.convert("RGB")))
        assert label == samples[i][1]


def test_train_transform_decodes_at_reduced_scale_without_visible_loss(photo_tree):
    root, _ = photo_tree
    with Image.open(os.path.join(root, "retina", "0000.jpg")) as source:
        big = source.convert("RGB").resize((1600, 1200))
    path = os.path.join(os.path.dirname(root), "big.jpg")
    big.save(path, quality=92)
    data = open(path, "rb").read()
    width, height = image_size(data)
    box = (400, 300, 900, 800)                       # a 500 px crop -> 224 px: decodable at 1/2 scale
    assert _scale_for(width, height, box, (224, 224)) == 2
    full = Image.open(path).convert("RGB").resize((224, 224), Image.BILINEAR, box=box)
    for decoder in ("simplejpeg", "pil"):
        reduced = decode_region(data, box, (224, 224), decoder).convert("RGB")
        diff = np.abs(np.asarray(reduced, np.float32) - np.asarray(full, np.float32)).mean()
        assert diff < 3.0, (decoder, diff)           # of 255: the same picture


def test_transforms_give_normalised_tensors_for_every_sample(store):
    train = InMemoryImageFolder(store, TrainTransform(seed=0))
    evaluation = InMemoryImageFolder(store, EvalTransform())
    for i in range(0, len(store), 7):               # JPEG colour and greyscale, progressive, PNG
        x, _ = train[i]
        y, _ = evaluation[i]
        assert x.shape == y.shape == (3, 224, 224) and x.dtype == torch.float32
        assert torch.isfinite(x).all() and -2.2 < float(x.min()) and float(x.max()) < 2.7
    plain = InMemoryImageFolder(store, lambda img: torch.from_numpy(np.asarray(img).copy()))   # any callable
    assert plain[3][0].dtype == torch.uint8


def test_eval_transform_matches_resize_then_centre_crop(store):
    data = store.sample_bytes(42)
    image = Image.open(__import__("io").BytesIO(bytes(data))).convert("RGB")
    s = 256 / min(image.size)
    resized = image.resize((round(image.width * s), round(image.height * s)), Image.BILINEAR)
    left, top = (resized.width - 224) // 2, (resized.height - 224) // 2
    reference = np.asarray(resized.crop((left, top, left + 224, top + 224)), np.float32)
    ours = EvalTransform(normalize=False)(data).permute(1, 2, 0).numpy().astype(np.float32)
    assert np.abs(ours - reference).mean() < 4.0


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_share_the_segment(store, context):
    dataset = InMemoryImageFolder(store, EvalTransform())
    assert len(pickle.dumps(dataset)) < store.blob_bytes / 100      # a handle, not the images
    loader = DataLoader(dataset, batch_size=16, num_workers=2, multiprocessing_context=context,
                        sampler=list(range(0, 64)))
    got = torch.cat([x for x, _ in loader])
    expected = torch.stack([dataset[i][0] for i in range(64)])
    assert torch.equal(got, expected)


def test_threaded_loader_equals_dataloader_and_resumes_exactly(store):
    dataset = InMemoryImageFolder(store, EvalTransform())
    def sampler():
        s = InMemoryDistributedSampler(dataset, num_replicas=2, rank=1, seed=5)
        s.set_epoch(2)
        return s
    reference = [(x, y) for x, y in DataLoader(dataset, batch_size=32, sampler=sampler())]
    loader = ThreadedLoader(dataset, batch_size=32, sampler=sampler(), num_threads=3, prefetch=2)
    ours = list(loader)
    assert len(ours) == len(reference) == len(loader) == math.ceil(150 / 32)
    for (a, la), (b, lb) in zip(ours, reference):
        assert torch.equal(a, b) and torch.equal(la, lb)
    # Stop after 2 batches (more are prefetched), save, resume in a new loader.
    first = ThreadedLoader(dataset, batch_size=32, sampler=sampler(), num_threads=3, prefetch=3)
    it = iter(first)
    taken = [next(it) for _ in range(2)]
    state = first.state_dict()
    assert state["consumed"] == 64
    resumed = ThreadedLoader(dataset, batch_size=32, sampler=InMemoryDistributedSampler(
        dataset, num_replicas=2, rank=1, seed=5), num_threads=2)
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(2)
    rest = list(resumed)
    labels = torch.cat([y for _, y in taken + rest])
    assert torch.equal(labels, torch.cat([y for _, y in reference]))


def test_memory_budget_uses_the_real_host_figures(monkeypatch):
    from mcallreduce.data.store import MemoryBudgetError, available_memory, check_memory_budget
    available, source = available_memory()
    assert available > 0 and source
    check_memory_budget(1 << 20, "a small store", "")                # fits: no error
    with pytest.raises(MemoryBudgetError) as err:
        check_memory_budget(available * 2, "the image store", "Run on more hosts.")
    message = str(err.value)
    assert f"{available * 2:,} bytes" in message and "Run on more hosts." in message
