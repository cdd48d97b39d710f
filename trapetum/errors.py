"""Errors a user can cause. The CLI prints them as one line and exits non-zero, without a traceback."""


class TrapetumError(Exception):
    """Base class of every user-facing error (bad file, bad argument, unsupported model)."""


class FormatError(TrapetumError):
    """A model file is missing, truncated, corrupt or of an unknown format/version."""


class ConfigError(TrapetumError):
    """A model configuration is inconsistent or names something this build does not support."""


class UnsupportedError(TrapetumError):
    """A valid request that this build cannot serve (unknown architecture, missing GPU, ...)."""
