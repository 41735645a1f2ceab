"""Where specdec keeps files on this machine: the model cache and the measured facts about the machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where assembled and converted models live ($SPECDEC_CACHE, else ~/.cache/specdec)."""
    root = os.environ.get("SPECDEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdec")
    return Path(root)


def measurements_dir() -> Path:
    """Where measured facts about this machine are kept (pass-cost curves, llama.cpp probe verdicts):
    $SPECDEC_MEASUREMENTS, else the model cache. The test suite points it at a directory of its own, which the
    servers and CLIs it starts inherit, so tiny test models leave nothing in the user's cache."""
    named = os.environ.get("SPECDEC_MEASUREMENTS")
    return Path(named) if named else cache_dir()
