"""Exceptions raised by mcallreduce (ConfigError lives in config.py with the variables)."""


class MismatchError(ValueError):
    """Ranks disagree on an allreduce's element count, dtype or settings; raised on every rank."""


class DeadlockError(RuntimeError):
    """A schedule played by the in-process executor or the simulator has steps that can never run."""
