"""Packing an ImageFolder tree into a store file, and reading it back."""
import os
import subprocess
import sys

import pytest

from _imagefolder import imagefolder_order
from mcallreduce.data.format import (CorruptImageError, StoreFile, StoreFormatError, pack,
                                     scan_image_folder)


def test_round_trip_bytes_labels_and_class_order(photo_tree, packed):
    root, bad = photo_tree
    path, report = packed
    store = StoreFile(path)
    classes, samples = imagefolder_order(root)
    kept = [(p, label) for p, label in samples if p not in bad]
    assert store.classes == classes
    assert len(store) == len(kept) == report.num_samples == 300
    assert [os.path.join(root, p) for p in store.paths] == [p for p, _ in kept]
    assert store.labels.tolist() == [label for _, label in kept]
    for i, (p, _) in enumerate(kept):
        assert store.read_sample(i) == open(p, "rb").read()
    assert int(store.offsets[-1]) == sum(os.path.getsize(p) for p, _ in kept) == report.blob_bytes


def test_corrupt_files_are_reported_with_path_and_skipped(photo_tree, packed, capfd):
    _, bad = photo_tree
    _, report = packed
    assert sorted(p for p, _ in report.skipped) == bad
    assert all(reason for _, reason in report.skipped)


def test_abort_on_corrupt_leaves_nothing_behind(photo_tree, tmp_path):
    root, bad = photo_tree
    dst = tmp_path / "out.mcstore"
    dst.write_bytes(b"previous contents")
    with pytest.raises(CorruptImageError) as err:
        pack(root, str(dst), workers=1, on_error="abort")
    assert bad[0] in str(err.value)
    assert dst.read_bytes() == b"previous contents"          # untouched: written atomically
    assert sorted(os.listdir(tmp_path)) == ["out.mcstore"]    # and no temporary file left


def test_empty_class_and_empty_tree_are_clear_errors(tmp_path):
    (tmp_path / "empty_tree").mkdir()
    with pytest.raises(FileNotFoundError, match="class folder"):
        pack(str(tmp_path / "empty_tree"), str(tmp_path / "a.mcstore"))
    tree = tmp_path / "tree"
    (tree / "cats").mkdir(parents=True)
    (tree / "dogs").mkdir()
    from PIL import Image
    Image.new("RGB", (8, 8)).save(tree / "cats" / "a.jpg")
    (tree / "dogs" / "notes.txt").write_text("no images here")
    with pytest.raises(FileNotFoundError, match="dogs"):
        scan_image_folder(str(tree))
    assert not (tmp_path / "a.mcstore").exists()


def test_damaged_store_is_refused(packed, copy_of):
    path, _ = packed
    for where in (20, os.path.getsize(path) - 5):   # in the header, then in the index (paths section)
        damaged = copy_of(path)
        with open(damaged, "r+b") as f:
            f.seek(where)
            byte = f.read(1)
            f.seek(where)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(StoreFormatError):
            StoreFile(damaged)
    truncated = copy_of(path)
    os.truncate(truncated, os.path.getsize(truncated) - 10)
    with pytest.raises(StoreFormatError):
        StoreFile(truncated)


def test_cli_pack_reports_and_exit_codes(photo_tree, tmp_path):
    root, bad = photo_tree
    out = subprocess.run([sys.executable, "-m", "mcallreduce.data", "pack", root, str(tmp_path / "t.mcstore"),
                          "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "packed 300 images in 10 classes" in out.stdout
    for path in bad:
        assert path in out.stderr
    assert len(StoreFile(str(tmp_path / "t.mcstore"))) == 300
    (tmp_path / "none").mkdir()
    out = subprocess.run([sys.executable, "-m", "mcallreduce.data", "pack", str(tmp_path / "none"), str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "class folder" in out.stderr


def test_pack_from_a_script_without_a_main_guard_fails_at_once_saying_why(clean_tree, tmp_path):
    # each spawned worker imports the script, which calls pack() again: the pool once respawned them forever
    script = tmp_path / "unguarded.py"
    script.write_text(f"import mcallreduce.data\nmcallreduce.data.pack({clean_tree!r}, {str(tmp_path / 's.mcstore')!r}, "
                      "workers=2, progress=False)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and 'if __name__ == "__main__":' in out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unguarded.py"]   # no store, no temporary file
