"""Fixtures: a small ImageFolder of real photographs (with bad files) and its packed store."""
import os
import shutil

import pytest

from mcallreduce.data.format import pack
from mcallreduce.data.photos import add_bad_files, make_photo_folder



@pytest.fixture(scope="session")
def photo_tree(tmp_path_factory):
    """(root, bad paths): 10 classes x 30 photographs (every 10th a PNG) plus 3 undecodable files."""
    root = str(tmp_path_factory.mktemp("photos") / "train")
    make_photo_folder(root, per_class=30, png_every=10, seed=1)
    bad = add_bad_files(root)
    return root, bad


@pytest.fixture(scope="session")
def clean_tree(tmp_path_factory):
    """The same photographs without bad files (for loading straight from the tree)."""
    root = str(tmp_path_factory.mktemp("clean") / "train")
    make_photo_folder(root, per_class=12, long_side=(64, 320), seed=2)
    return root


@pytest.fixture(scope="session")
def packed(photo_tree, tmp_path_factory):
    root, _ = photo_tree
    path = str(tmp_path_factory.mktemp("store") / "train.mcstore")
    report = pack(root, path, workers=2)
    return path, report


@pytest.fixture
def copy_of(tmp_path):
    def _copy(path):
        dst = tmp_path / os.path.basename(path)
        shutil.copyfile(path, dst)
        return str(dst)
    return _copy


