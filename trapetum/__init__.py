"""Trapetum: compress LLM checkpoints into .cbk codebook files and run them fast."""
from ._version import __version__  # noqa: F401  (trapetum.__version__)

from .errors import TrapetumError, FormatError, ConfigError, UnsupportedError  # noqa: F401


def load(path=None, **kwargs):
    """Load a model (HF directory, .gguf or .cbk; None = the embedded default). See trapetum.api.Model."""
    from .api import load as _load
    return _load(path, **kwargs)
