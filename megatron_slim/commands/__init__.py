"""Implementations of the ``megatron-slim`` subcommands (``cli.py`` only parses and dispatches)."""
