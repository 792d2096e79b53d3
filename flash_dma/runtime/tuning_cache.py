"""Persistent launch-configuration cache and profiling log.

Tuning sweeps are expensive (each candidate compiles and is timed), so whatever a sweep finds is
written to a JSON file keyed by device, Triton version, kernel and problem bucket, and read back by
every later process. Every timed candidate is also appended to a JSON-lines profiling log, so a
sweep can be inspected after the fact.

Location: $FLASH_DMA_CACHE_DIR, else ~/.cache/flash_dma.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()
_MEMORY: dict[str, dict[str, Any]] | None = None
# Bumped whenever entries may have changed: configuration choices memoised on the hot path
# (config.remember_until_retuned) are recomputed after a sweep stores a winner.
_GENERATION = 0


def generation() -> int:
    return _GENERATION


def cache_dir() -> Path:
    root = os.environ.get("FLASH_DMA_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "flash_dma"


def _cache_file() -> Path:
    return cache_dir() / "tuning-v1.json"


def profile_log_file() -> Path:
    return cache_dir() / "profile.jsonl"


def _load() -> dict[str, dict[str, Any]]:
    global _MEMORY
    if _MEMORY is None:
        try:
            _MEMORY = json.loads(_cache_file().read_text())
        except (OSError, ValueError):
            _MEMORY = {}
    return _MEMORY


def lookup(key: str) -> dict[str, Any] | None:
    with _LOCK:
        return _load().get(key)


def entries() -> dict[str, dict[str, Any]]:
    with _LOCK:
        return dict(_load())


def store(key: str, value: dict[str, Any]) -> None:
    """Record a tuned value and rewrite the cache file atomically (never a half-written file)."""
    global _GENERATION
    with _LOCK:
        entries = _load()
        entries[key] = value
        _GENERATION += 1
        path = _cache_file()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-")
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only home must not break the kernels; the in-memory entry still serves


def log_profile(record: dict[str, Any]) -> None:
    record = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), **record}
    try:
        path = profile_log_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


def forget_memory() -> None:
    """Drop the in-memory copy so the next lookup rereads the file (tests use this)."""
    global _MEMORY, _GENERATION
    with _LOCK:
        _MEMORY = None
        _GENERATION += 1
