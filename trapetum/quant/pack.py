"""Moved to ``trapetum.kernels.pack`` (the kernels define the packing they read); kept until the importers move."""
from ..kernels.pack import *  # noqa
from ..kernels.pack import __all__  # noqa
