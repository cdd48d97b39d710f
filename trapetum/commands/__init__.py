"""One module per CLI command; each exposes ``register(subparsers)`` (see trapetum/cli.py)."""
