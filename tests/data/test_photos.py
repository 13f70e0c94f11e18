"""The bundled image sets: an ImageNet-like tree and scikit-learn's digits as JPEG folders."""
import os

from PIL import Image

from mcallreduce.data.__main__ import main
from mcallreduce.data.format import scan_image_folder


def test_imagenet_like_set_has_imagenets_sizes(tmp_path):
    assert main(["make-imagenet-like", str(tmp_path), "--train-per-class", "6", "--val-per-class", "2"]) == 0
    train, val = scan_image_folder(str(tmp_path / "train")), scan_image_folder(str(tmp_path / "val"))
    assert len(train) == 60 and len(val) == 20 and train.classes == val.classes
    sizes = [os.path.getsize(os.path.join(train.root, p)) for p in train.paths]
    assert 70_000 < sum(sizes) / len(sizes) < 160_000          # ImageNet's mean is about 110 KB
    for p in train.paths:
        with Image.open(os.path.join(train.root, p)) as image:
            assert 350 <= max(image.size) <= 500


def test_digits_folder_holds_every_digit_once_with_a_stratified_split(tmp_path):
    assert main(["make-digits", str(tmp_path), "--size", "24"]) == 0
    train, val = scan_image_folder(str(tmp_path / "train")), scan_image_folder(str(tmp_path / "val"))
    assert train.classes == val.classes == [str(d) for d in range(10)]
    assert len(train) + len(val) == 1797
    names = {os.path.basename(p) for p in train.paths} | {os.path.basename(p) for p in val.paths}
    assert len(names) == 1797                                    # no digit in both splits
    for label in range(10):
        n_val, n_train = int((val.labels == label).sum()), int((train.labels == label).sum())
        assert abs(n_val / (n_val + n_train) - 0.2) < 0.01
    with Image.open(os.path.join(val.root, val.paths[0])) as image:
        assert image.size == (24, 24) and image.mode == "L"
