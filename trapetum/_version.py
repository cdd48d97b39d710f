"""The package version, in a module of its own so that low layers (the .cbk writer) can read it without
importing the package root (which imports the API)."""
__version__ = "0.1.0"
