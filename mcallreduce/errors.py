"""Exceptions raised by mcallreduce, one class per meaning."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the variable and the allowed values."""


class MismatchError(ValueError):
    """Ranks disagree on an allreduce's element count, dtype or settings; raised on every rank."""


class DeadlockError(RuntimeError):
    """A schedule played by the in-process executor or the simulator has steps that can never run."""
