"""torchvision's ``ImageFolder`` without torchvision: one file read from disk per sample.

The baseline a user has today, for machines where torchvision does not import
(its PyPI wheels fail beside a CPU build of torch). Same order of classes and
samples, same attributes (``classes``, ``class_to_idx``, ``samples``, ``targets``),
same ``(image, target)`` items; transforms get what :func:`.transforms.apply` gives.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

from .dataset import EncodedImageDataset
from .format import IMG_EXTENSIONS, scan_image_folder


class ImageFolder(EncodedImageDataset):

    def __init__(self, root: str, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None, extensions=IMG_EXTENSIONS):
        index = scan_image_folder(root, extensions)
        self.root = index.root
        self.classes: List[str] = index.classes
        self.class_to_idx: Dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        self.samples: List[Tuple[str, int]] = [(os.path.join(index.root, path), int(label))
                                               for path, label in zip(index.paths, index.labels)]
        self.targets: List[int] = [label for _, label in self.samples]
        self.transform, self.target_transform = transform, target_transform

    @property
    def imgs(self) -> List[Tuple[str, int]]:
        return self.samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, target = self.samples[index]
        with open(path, "rb") as f:
            data = f.read()
        return self._item(index, data, target)

    def _where(self, index: int) -> str:
        return self.samples[index][0]
