"""The `batchrun` command line (main.py: the commands; options.py: their option groups)."""

from batchrun.cli.main import main

__all__ = ["main"]
