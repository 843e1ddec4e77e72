"""Where layerdrop keeps what it downloads and converts: one cache folder for models, task data and test exports."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache folder: `$LAYERDROP_CACHE` where set (and not empty), else ~/.cache/layerdrop. Not created here."""
    return Path(os.environ.get("LAYERDROP_CACHE") or Path.home() / ".cache" / "layerdrop")
