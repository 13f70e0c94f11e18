"""Dataset, transforms and loaders over the in-memory store (single process)."""
import copy
import math
import os
import pickle
import random

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from _imagefolder import imagefolder_order
from mcallreduce.data import (EvalTransform, ImageFolder, ImageStore, InMemoryDistributedSampler,
                              InMemoryImageFolder, StoreFile, ThreadedLoader, TrainTransform)
from mcallreduce.data import transforms as transforms_mod
from mcallreduce.data.crop_boxes import random_resized_crop_box
from mcallreduce.data.decode import _scale_for, decode_crop, decode_region, image_size
from mcallreduce.data.normalize import Normalize
from mcallreduce.data.resize import _cv2, _torch_resize_op, crop_resize, resizer_name

# The antialiased resizers available here (torch's kernel needs torch >= 2.1 on AVX2); cv2 is opt-in, not antialiased.
ANTIALIASED = ["pil"] + (["torch"] if _torch_resize_op() is not None else [])
ALL_RESIZERS = ANTIALIASED + (["cv2"] if _cv2() is not None else [])


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


def test_a_sample_that_fails_names_its_path_only_then(store, packed, clean_tree, monkeypatch):
    paths = StoreFile(packed[0]).paths

    def broken(image):
        raise ValueError("cannot use this image")

    with pytest.raises(ValueError) as error:
        InMemoryImageFolder(store, transform=broken)[7]
    assert str(error.value) == "cannot use this image" and f"sample 7 ({paths[7]})" in " ".join(error.value.__notes__)
    folder = ImageFolder(clean_tree, transform=broken)
    with pytest.raises(ValueError) as error:
        folder[3]
    assert str(error.value) == "cannot use this image"
    assert f"sample 3 ({folder.samples[3][0]})" in " ".join(error.value.__notes__)

    class TwoPartError(Exception):   # an exception whose constructor takes more than a message
        def __init__(self, code, detail):
            super().__init__(code, detail)

    def broken_twice(image):
        raise TwoPartError(7, "bad")

    with pytest.raises(TwoPartError) as error:   # once a TypeError from rebuilding it around a message
        InMemoryImageFolder(store, transform=broken_twice)[2]
    assert error.value.args == (7, "bad") and f"sample 2 ({paths[2]})" in " ".join(error.value.__notes__)
    # a sample that loads looks up no path: the packed file's path table is read only for a message
    monkeypatch.setattr(type(store), "sample_path", lambda self, i: pytest.fail("path looked up"))
    assert InMemoryImageFolder(store)[7][1] == int(store.labels[7])


def test_loading_straight_from_a_folder(clean_tree):
    dataset = InMemoryImageFolder(clean_tree, num_replicas=1, rank=0)
    classes, samples = imagefolder_order(clean_tree)
    assert dataset.classes == classes and len(dataset) == len(samples)
    for i in (0, len(samples) // 2, len(samples) - 1):
        image, label = dataset[i]
        with Image.open(samples[i][0]) as expected:
            assert np.array_equal(np.asarray(image), np.asarray(expected.convert("RGB")))
        assert label == samples[i][1]


def test_the_folder_dataset_reads_what_imagefolder_reads(clean_tree):
    folder = ImageFolder(clean_tree)
    memory = InMemoryImageFolder(clean_tree, num_replicas=1, rank=0)
    classes, samples = imagefolder_order(clean_tree)
    assert folder.classes == classes and folder.samples == samples and folder.targets == [y for _, y in samples]
    for i in (0, len(samples) // 2, len(samples) - 1):
        (a, la), (b, lb) = folder[i], memory[i]
        assert la == lb == samples[i][1] and np.array_equal(np.asarray(a), np.asarray(b))


def _crops(dataset, loader: str, epoch: int):
    sampler = InMemoryDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    sampler.set_epoch(epoch)
    if loader == "threads":
        batches = ThreadedLoader(dataset, batch_size=16, sampler=sampler, num_threads=3)
    else:
        batches = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=int(loader))
    return torch.cat([x for x, _ in batches])


def test_seeded_crops_depend_on_seed_epoch_and_index_only(store):
    dataset = InMemoryImageFolder(store, TrainTransform(size=48, seed=9, normalize=False))
    reference = _crops(dataset, "0", epoch=3)
    assert torch.equal(_crops(dataset, "2", epoch=3), reference)        # any number of workers ...
    assert torch.equal(_crops(dataset, "threads", epoch=3), reference)  # ... or threads
    other_epoch = _crops(dataset, "2", epoch=4)
    assert (other_epoch != reference).flatten(1).any(1).float().mean() > 0.9   # a new draw every epoch
    other_seed = InMemoryImageFolder(store, TrainTransform(size=48, seed=10, normalize=False))
    assert (_crops(other_seed, "0", epoch=3) != reference).flatten(1).any(1).float().mean() > 0.9


@pytest.mark.parametrize("seed", [None, 3])
def test_dataloader_workers_draw_different_crops(store, seed):
    """One sample 32 times, a batch to each of 2 workers, no sampler of ours (no epoch key):
    the workers must not replay one generator copied into both, nor replay it the next epoch.
    A replayed generator repeats every crop; two fresh draws may still agree now and then (the
    same fallback centre crop and flip), so nine in ten must differ, as across epochs above."""
    dataset = InMemoryImageFolder(store, TrainTransform(size=48, seed=seed, normalize=False))
    loader = DataLoader(dataset, batch_size=16, sampler=[7] * 32, num_workers=2)
    first, second = [x for x, _ in loader]
    assert (first != second).flatten(1).any(1).float().mean() > 0.9
    again = torch.cat([x for x, _ in loader])
    assert (again != torch.cat([first, second])).flatten(1).any(1).float().mean() > 0.9


def test_a_compose_keeps_the_reduced_scale_decode(store, monkeypatch):
    class Compose:     # torchvision.transforms.Compose's shape
        def __init__(self, transforms):
            self.transforms = transforms

        def __call__(self, x):
            for t in self.transforms:
                x = t(x)
            return x
    train = TrainTransform(size=48, seed=2, normalize=False)
    dataset = InMemoryImageFolder(store, Compose([train, lambda t: t.flip(0)]))
    dataset.set_epoch(1)
    want = train(store.sample_bytes(5), key=(1, 5)).flip(0)

    def full_decode(data):
        raise AssertionError("decoded in full")
    monkeypatch.setattr(transforms_mod, "decode_image", full_decode)
    assert torch.equal(dataset[5][0], want)


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
        for resizer in ALL_RESIZERS:
            reduced = decode_region(data, box, (224, 224), decoder, resizer=resizer).convert("RGB")
            diff = np.abs(np.asarray(reduced, np.float32) - np.asarray(full, np.float32)).mean()
            assert diff < 3.0, (decoder, resizer, diff)           # of 255: the same picture


def test_crop_resize_matches_a_reference_antialiased_resize(store):
    """Each resizer against Pillow's antialiased BILINEAR resize of the box on the full decode (what
    torchvision's RandomResizedCrop does on PIL images): a small mean absolute difference, of 255."""
    rng = random.Random(3)
    diffs = {r: [] for r in ALL_RESIZERS}
    for i in range(0, len(store), 5):
        data = bytes(store.sample_bytes(i))
        image = Image.open(__import__("io").BytesIO(data)).convert("RGB")
        box = random_resized_crop_box(image.width, image.height, rng=rng)
        reference = np.asarray(image.resize((224, 224), Image.BILINEAR, box=box), np.float32).transpose(2, 0, 1)
        for r in ALL_RESIZERS:
            ours = decode_crop(data, box, (224, 224), "simplejpeg", resizer=r)
            assert ours.shape == (3, 224, 224) and ours.dtype == np.uint8 and ours.flags.c_contiguous
            flipped = decode_crop(data, box, (224, 224), "simplejpeg", flip=True, resizer=r)
            assert np.array_equal(flipped, ours[:, :, ::-1])
            diffs[r].append(np.abs(ours.astype(np.float32) - reference).mean())
    for r, d in diffs.items():
        mean, worst = float(np.mean(d)), float(np.max(d))
        if r in ANTIALIASED:     # the same filter: only libjpeg's reduced decode of big boxes differs
            assert mean < 0.3 and worst < 5.0, (r, mean, worst)
        else:                    # cv2 INTER_LINEAR: no antialiasing when shrinking
            assert mean < 2.0 and worst < 8.0, (r, mean, worst)
    if "torch" in ANTIALIASED:   # torch's kernel is a port of Pillow's: within rounding
        assert np.mean(diffs["torch"]) < 0.1
        assert resizer_name() == "torch"


def test_every_decode_thread_asking_for_the_resizer_at_once_gets_the_probes_answer(monkeypatch):
    import threading
    from concurrent.futures import ThreadPoolExecutor
    import mcallreduce.data.resize as resize
    want = resize._torch_resize_op()
    if want is None:
        pytest.skip("no torch resize kernel on this CPU: every thread gets Pillow, nothing to race for")
    for _ in range(20):
        monkeypatch.setattr(resize, "_torch_aa", None)   # a fresh process: not probed yet
        start = threading.Barrier(4)

        def ask(_):
            start.wait()
            return resize._torch_resize_op()
        with ThreadPoolExecutor(4) as pool:
            assert all(got is want for got in pool.map(ask, range(4)))


def test_torch_resize_stays_in_the_calling_thread():
    """The decode threads call torch's resize at once: it must not enter torch's intra-op pool
    (an OpenMP team per calling thread oversubscribes the cores)."""
    if "torch" not in ANTIALIASED or not os.path.isdir("/proc/self/task"):
        pytest.skip("torch's uint8 antialiased kernel not available here")
    import threading
    array = np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    counts = []

    def work():
        for flip in (False, True):
            crop_resize(array, (10, 20, 500, 400), (224, 224), flip, "torch")
        counts.append(len(os.listdir("/proc/self/task")))    # an OpenMP team would still be alive here

    before = len(os.listdir("/proc/self/task"))
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert counts == [before + 1]


def test_batch_normalize_equals_per_image_normalisation(store):
    dataset = InMemoryImageFolder(store, EvalTransform())
    raw = InMemoryImageFolder(store, EvalTransform(normalize=False))
    indices = list(range(0, 64, 3))
    expected = torch.stack([dataset[i][0] for i in indices])
    batch = torch.stack([raw[i][0] for i in indices])
    assert batch.dtype == torch.uint8
    for channels_last in (False, True):
        got = Normalize(channels_last=channels_last)(batch)
        assert got.dtype == torch.float32 and torch.allclose(got, expected, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert Normalize(dtype=torch.float16)(batch).dtype == torch.float16
    with pytest.raises(TypeError):
        Normalize()(expected)                       # float input: already normalised
    # The device branch (one torch kernel after the copy; "cuda" in training), checked on the meta device.
    on_device, labels = Normalize(device="meta", channels_last=True)((batch, torch.arange(len(indices))))
    assert on_device.device.type == labels.device.type == "meta" and on_device.dtype == torch.float32
    assert on_device.shape == batch.shape and on_device.is_contiguous(memory_format=torch.channels_last)
    # In the loader: uint8 from the decode threads, one pass per batch, same tensors as per-image normalise.
    sampler = list(range(40))
    ours = list(ThreadedLoader(raw, batch_size=16, sampler=sampler, num_threads=2, batch_transform=Normalize()))
    reference = list(ThreadedLoader(dataset, batch_size=16, sampler=sampler, num_threads=2))
    assert len(ours) == len(reference) == 3
    for (a, la), (b, lb) in zip(ours, reference):
        assert a.dtype == torch.float32 and torch.allclose(a, b, atol=1e-5) and torch.equal(la, lb)
    # The same boxes and flips (same seed) give the same training tensors, uint8 + Normalize or float.
    data = [store.sample_bytes(i) for i in range(8)]
    a = Normalize()(torch.stack([TrainTransform(seed=4, normalize=False)(d) for d in data[:1]] +
                                [TrainTransform(seed=5, normalize=False)(d) for d in data[1:2]]))
    b = torch.stack([TrainTransform(seed=4)(data[0]), TrainTransform(seed=5)(data[1])])
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_batch_normalize_on_the_gpu_equals_per_image_normalisation(store):
    """The device branch for real: uint8 batches from the loader's pinned memory, normalised on the GPU."""
    dataset = InMemoryImageFolder(store, EvalTransform())
    raw = InMemoryImageFolder(store, EvalTransform(normalize=False))
    indices = list(range(0, 64, 3))
    expected = torch.stack([dataset[i][0] for i in indices])
    batch = torch.stack([raw[i][0] for i in indices]).pin_memory()
    for channels_last in (False, True):
        got, labels = Normalize(device="cuda", channels_last=channels_last)((batch, torch.arange(len(indices))))
        assert got.device.type == labels.device.type == "cuda" and got.dtype == torch.float32
        assert torch.allclose(got.cpu(), expected, atol=1e-5)
        assert got.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert torch.equal(labels.cpu(), torch.arange(len(indices)))
    half = Normalize(device="cuda", dtype=torch.float16)(batch)
    assert half.dtype == torch.float16 and torch.allclose(half.float().cpu(), expected, atol=2e-2)
    sampler = list(range(40))
    ours = list(ThreadedLoader(raw, batch_size=16, sampler=sampler, num_threads=2,
                               batch_transform=Normalize(device="cuda")))
    reference = list(ThreadedLoader(dataset, batch_size=16, sampler=sampler, num_threads=2))
    for (a, la), (b, lb) in zip(ours, reference):
        assert a.is_cuda and torch.allclose(a.cpu(), b, atol=1e-5) and torch.equal(la.cpu(), lb)


def test_transforms_give_normalised_tensors_for_every_sample(store):
    train = InMemoryImageFolder(store, TrainTransform(seed=0))
    evaluation = InMemoryImageFolder(store, EvalTransform())
    for i in range(0, len(store), 7):               # JPEG colour and greyscale, progressive, PNG
        x, _ = train[i]
        y, _ = evaluation[i]
        assert x.shape == y.shape == (3, 224, 224) and x.dtype == torch.float32
        assert torch.isfinite(x).all() and -2.2 < float(x.min()) and float(x.max()) < 2.7
    for resizer in ALL_RESIZERS:                    # every resizer, on every kind of file
        train = InMemoryImageFolder(store, TrainTransform(seed=0, normalize=False, resizer=resizer))
        for i in range(0, len(store), 23):
            x, _ = train[i]
            assert x.shape == (3, 224, 224) and x.dtype == torch.uint8
    with pytest.raises(ValueError):
        TrainTransform(resizer="bicubic")
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


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_follow_set_epoch(store, context):
    # a persistent worker keeps the dataset it started with: the epoch reaches it through the board
    dataset = InMemoryImageFolder(store, TrainTransform(size=48, seed=9, normalize=False))
    sampler = InMemoryDistributedSampler(dataset, num_replicas=1, rank=0, seed=4)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2, persistent_workers=True,
                        multiprocessing_context=context)
    for epoch in (0, 1, 2):
        sampler.set_epoch(epoch)
        got = torch.cat([x for x, _ in loader])
        expected = torch.stack([dataset[i][0] for i in sampler])   # drawn here, in the rank
        assert torch.equal(got, expected), epoch


def test_a_copy_of_a_dataset_sets_its_own_epoch(store):
    dataset = InMemoryImageFolder(store, TrainTransform(size=48, seed=9, normalize=False))
    dataset.set_epoch(1)
    copied = copy.deepcopy(dataset)   # its board re-attaches read-only: it follows until it sets its own
    assert copied.epoch == 1
    copied.set_epoch(5)
    dataset.set_epoch(2)
    assert (dataset.epoch, copied.epoch) == (2, 5)


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


def test_the_memory_limit_counts_what_the_host_holds_already(packed, monkeypatch):
    from mcallreduce.data.shm import held_bytes
    from mcallreduce.data.store import MemoryBudgetError
    before = held_bytes()   # other tests' stores, still open
    first = ImageStore.open(packed[0])
    one = held_bytes() - before
    assert one >= first.segment.size   # and its small boards
    monkeypatch.setenv("MCALLREDUCE_DATA_MEMORY_FRACTION", "1")
    monkeypatch.setenv("MCALLREDUCE_DATA_MEMORY_LIMIT", str(before + one + one // 2))   # room for one more, not two
    with pytest.raises(MemoryBudgetError, match="less the"):   # each store alone fits: it once passed
        ImageStore.open(packed[0])
    first.close()
    ImageStore.open(packed[0]).close()   # what was held is given back


def test_a_sampler_finds_the_store_behind_a_wrapper_that_names_its_dataset(store):
    from mcallreduce.data.sampler import _store_of

    class Wrapper(torch.utils.data.Dataset):
        def __init__(self, dataset):
            self.dataset = dataset

        def __len__(self):
            return len(self.dataset)

    dataset = InMemoryImageFolder(store)
    assert _store_of(Wrapper(Wrapper(dataset))) is store and _store_of(torch.utils.data.Subset(dataset, [0])) is store
    assert _store_of(Wrapper(list(range(3)))) is None


def test_a_store_of_several_ranks_without_mpi_says_it_needs_mpi(packed):
    with pytest.raises(RuntimeError, match="needs MPI"):
        ImageStore.open(packed[0], num_replicas=2, rank=1)


def test_a_torchrun_launch_without_init_process_group_is_told_so(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="init_process_group"):
        InMemoryDistributedSampler(range(10))


def test_a_store_opened_without_mpi_does_not_make_a_torchrun_world_one_rank(store, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="init_process_group"):
        InMemoryDistributedSampler(store)
    half = InMemoryDistributedSampler(store, num_replicas=2, rank=1)
    assert len(half) == -(-len(store) // 2)


def test_under_torchrun_the_sampler_takes_torch_distributeds_world():
    import socket
    import subprocess
    import sys
    from pathlib import Path
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    script = Path(__file__).parent / "torchrun_sampler.py"
    root = Path(__file__).parents[2]
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONPATH": str(root), "RANK": str(r),
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs


def test_a_sigterm_handler_that_returns_leaves_the_segment_working_and_no_file(monkeypatch):
    # a job's own handler that only sets a flag (graceful shutdown): the segment's handler unlinks
    # the name, runs it, and creating the segment goes on as without the signal
    import glob
    import signal
    from mcallreduce.data.shm import SharedSegment
    seen = []

    def graceful(signum, frame):
        seen.append(signum)
    previous = signal.signal(signal.SIGTERM, graceful)
    mapped = SharedSegment._map

    def map_then_sigterm(self, *args):
        mapped(self, *args)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(SharedSegment, "_map", map_then_sigterm)
    before = set(glob.glob("/dev/shm/mcallreduce-data-*"))
    try:
        segment = SharedSegment(None, 1 << 20, tag="returning-handler")
        segment.array[:4] = 7
        assert seen == [signal.SIGTERM]
        assert set(glob.glob("/dev/shm/mcallreduce-data-*")) <= before
        assert signal.getsignal(signal.SIGTERM) is graceful   # the job's own handler is back
        segment.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_segment_name_that_a_sigkill_left_is_removed_by_the_next_segment():
    # SIGKILL between creating the file and every rank mapping it leaves the name, and with it the memory
    import fcntl
    import time
    from mcallreduce.data import shm
    old = time.time() - 2 * shm.LEFTOVER_AGE_S
    paths, live = {}, None
    for what, mtime in (("killed", old), ("young", None), ("live", old)):
        path = os.path.join(shm._directory(), f"{shm.NAME_PREFIX}test-{what}-{os.getpid()}-0123456789ab")
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        paths[what] = path
    live = os.open(paths["live"], os.O_RDONLY)   # its creator's lock, held for as long as the job lives
    fcntl.flock(live, fcntl.LOCK_SH)
    try:
        segment = shm.SharedSegment(None, 1 << 16, tag="sweeper")
        segment.close()
        assert not os.path.exists(paths["killed"])
        assert os.path.exists(paths["young"]) and os.path.exists(paths["live"])   # maybe a job's, mapping it now
    finally:
        os.close(live)
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)
