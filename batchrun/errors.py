"""Errors that end a run; each carries the CLI exit code (batchrun/cli/main.py's table)."""

from __future__ import annotations


class RunError(Exception):
    """A run that cannot start or go on; the message says what to do."""

    exit_code = 1


class OptionError(RunError):
    """Options that cannot apply to this input; nothing was started."""

    exit_code = 2


class InputError(RunError):
    exit_code = 3


class ModelError(RunError):
    exit_code = 4


class ModelConfigError(ValueError):
    """A config.json batchrun cannot run; the message says what is supported."""


class WeightLoadError(ValueError):
    """A checkpoint batchrun cannot load; the message names the file and tensor."""
