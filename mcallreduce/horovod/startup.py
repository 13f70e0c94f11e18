"""The startup hook: patch ``horovod.torch`` as it is imported, when the environment asks.

``mcallreduce-horovod.pth`` in site-packages runs one line at every interpreter start. With
no MCALLREDUCE_HOROVOD / MCALLREDUCE_ALGORITHM set it only reads two environment variables;
otherwise it calls :func:`install`, which puts a finder at the front of ``sys.meta_path``.
The finder lets the normal path finder locate ``horovod.torch`` and wraps that spec's
``exec_module`` so the package is patched right after its own code ran, before the user's
script sees it. Stock Horovod's files are never modified.

    python -m mcallreduce.horovod.startup install     # write the .pth into site-packages
    python -m mcallreduce.horovod.startup uninstall
    python -m mcallreduce.horovod.startup status
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import sysconfig
from pathlib import Path

from .. import config

PTH_NAME = "mcallreduce-horovod.pth"
TARGET = "horovod.torch"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        original = spec.loader.exec_module

        def exec_module(module):   # this loader object belongs to this one import only
            original(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


_FINDER = _PatchOnImport()


def _patch(module) -> None:
    if not getattr(module, "_MPI_LIB_AVAILABLE", False):
        return   # Horovod built without its torch extension: nothing to route
    from .patch import patch_horovod_torch
    patch_horovod_torch(module)


def install() -> None:
    """Arrange for horovod.torch to be patched on import, if the environment asks for it."""
    try:
        wanted = config.horovod_requested_by_startup_hook()
    except ValueError as exc:   # a bad MCALLREDUCE_HOROVOD value: say so, keep stock Horovod
        print(f"mcallreduce: {exc}; Horovod stays stock", file=sys.stderr)
        return
    if not wanted:
        return
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def pth_source() -> Path:
    return Path(__file__).with_name(PTH_NAME)


def pth_target() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "status"
    target = pth_target()
    if command == "install":
        text = pth_source().read_text()
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            print(f"installed {target}", file=sys.stderr)
        return 0
    if command == "uninstall":
        target.unlink(missing_ok=True)
        return 0
    if command == "status":
        installed = target.exists() and target.read_text() == pth_source().read_text()
        print(f"{target}: {'installed' if installed else 'not installed'}")
        return 0 if installed else 1
    print("usage: python -m mcallreduce.horovod.startup install|uninstall|status", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
