"""The exceptions autosel raises beyond the original selector's KeyError/ValueError contract."""

from __future__ import annotations


class AutoselError(Exception):
    """Base class: every message says what failed, with the values, and what to do next."""


class ConfigError(AutoselError, ValueError):
    """An AUTOSEL_* environment variable has a value autosel does not accept."""


class DatabaseError(AutoselError):
    """A tuning database cannot be used as asked (not a DB, newer schema, unwritable output)."""


class TuningError(AutoselError, ValueError):
    """Tuning ran but could not produce a decision (for example every candidate was rejected)."""


class NoCandidateError(TuningError):
    """Every candidate of a tune was rejected; the message lists each one's reason, and the caller adds what to
    do (at run time: pass backend=...; on the command line: leave the op out with --op)."""


class IntegrationError(AutoselError):
    """A model is not what an integration (autosel.integrations) was written for; the model is left unchanged."""


class DeviceError(AutoselError, ValueError):
    """The GPUs asked for (`autosel tune --devices`, tune_ops(devices=...)) are not visible to this process."""


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived during a tune (parallel.termination_raises): raised where the process is, as Ctrl-C
    is, so that every `finally` runs (the isolation child killed, the tuning lease released). signum: the signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
