"""``import mcallreduce.horovod.torch as hvd``: all of ``horovod.torch``, with the allreduce
family and DistributedOptimizer routed through mcallreduce once ``hvd.init()`` ran.

Still governed by the environment: ``MCALLREDUCE_HOROVOD=0`` gives stock Horovod;
``MCALLREDUCE_ALGORITHM`` picks the algorithm (default multicolor).
"""
import sys as _sys

from .. import config as _config

import horovod.torch as _hvd   # noqa: E402  (the startup hook may already have patched it)

if _config.horovod_requested_by_import() and getattr(_hvd, "_MPI_LIB_AVAILABLE", False):
    from .patch import patch_horovod_torch as _patch
    _patch(_hvd)

from horovod.torch import *  # noqa: E402,F401,F403  (copies the patched names)

_self = _sys.modules[__name__]
for _name in dir(_hvd):
    if not _name.startswith("__") and not hasattr(_self, _name):
        setattr(_self, _name, getattr(_hvd, _name))


def __getattr__(name):   # anything added to horovod.torch later
    return getattr(_hvd, name)
