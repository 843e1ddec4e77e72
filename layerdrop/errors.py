"""Exception types of layerdrop; the CLI turns each into one clear line."""

from __future__ import annotations


class LayerdropError(Exception):
    """Bad input or an impossible request: the CLI prints the message and exits 2."""

    exit_code = 2


class OutputError(LayerdropError):
    """An output could not be written (disk full, permissions): exit 1."""

    exit_code = 1


class OverBudget(LayerdropError):
    """A model is over a budget given to `layerdrop check`: exit 1."""

    exit_code = 1


class TooFewTokens(LayerdropError):
    """A fit was asked of fewer calibration tokens than it has unknowns per output: exit 2."""
