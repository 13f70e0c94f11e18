"""Exceptions raised by mcallreduce, one class per meaning: here those more than one part raises;
a part's own (the data store's file format, the bench's cluster) stand beside its code."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the variable and the allowed values."""


class MismatchError(ValueError):
    """Ranks disagree on an allreduce's element count, dtype or settings; raised on every rank."""


class MemoryBudgetError(MemoryError):
    """Memory that a store, an epoch's exchange or a shared segment needs is not there; nothing was reserved."""


class DeadlockError(RuntimeError):
    """A schedule played by the in-process executor or the simulator has steps that can never run."""
