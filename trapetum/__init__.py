"""Trapetum: compress LLM checkpoints into .cbk codebook files and run them fast."""
from ._version import __version__  # noqa: F401  (trapetum.__version__)

from .errors import TrapetumError, FormatError, ConfigError, UnsupportedError  # noqa: F401


def load(path=None, **kwargs):
    """Load a model (HF directory, .gguf or .cbk; None = the embedded default). See trapetum.api.Model."""
    from .api import load as _load
    return _load(path, **kwargs)


def sparsify(model, calib, sparsity, sites=None, out=None, **kwargs):
    """Activation-sparsity thresholds for ``model`` from the text file ``calib`` at target ``sparsity`` (``sites``:
    per-site overrides, "q=..,o=..,gate=..,down=.." or a dict), written into a .cbk or a side file; returns
    (SparsityTable, path). See trapetum.quant.sparsify."""
    from .quant.sparsify import sparsify as _sparsify
    return _sparsify(model, calib, sparsity, sites, out, **kwargs)
