"""The profiling log of launch choices: which configuration ran for a shape, and why.

With FLASH_DMA_PROFILE=1 in the environment, each kernel pass logs one line through Python's
logging (logger "flash_dma", level INFO) the first time it meets a new shape class, e.g.

    flash_dma: op=attention pass=bwd_dkdv backend=triton arch=sm90 smem=227KB D=128 Sq=8192
    Sk=8192 B=2 H=16 Hk=16 mask=tiles bias=B,H,Sq,Sk choice=BM64_BN128_W8_S2 source=table

A class already seen costs one set lookup; with the variable unset, one boolean test.
"""
from __future__ import annotations

import logging
import os

from .hardware import DeviceInfo

LOGGER = logging.getLogger("flash_dma")
_SEEN: set = set()


def enabled() -> bool:
    return os.environ.get("FLASH_DMA_PROFILE", "0") not in ("", "0")


_ENABLED = enabled()


def refresh() -> None:
    """Re-read FLASH_DMA_PROFILE (tests, or a program that sets it after importing flash_dma)."""
    global _ENABLED
    _ENABLED = enabled()
    _SEEN.clear()


def log_choice(op: str, pass_name: str, backend: str, info: DeviceInfo, shape: tuple,
               choice: str, source: str) -> None:
    """shape: (name, value) pairs describing the shape class (lengths, heads, mask and bias
    kinds, ...); logged once per distinct (op, pass, backend, device, shape, choice)."""
    if not _ENABLED:
        return
    key = (op, pass_name, backend, info.name, shape, choice, source)
    if key in _SEEN:
        return
    _SEEN.add(key)
    if not LOGGER.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        LOGGER.addHandler(handler)
        LOGGER.setLevel(logging.INFO)
    arch = f"sm{info.arch}" if info.arch else "interpreter"
    fields = " ".join(f"{name}={value}" for name, value in shape)
    LOGGER.info(f"op={op} pass={pass_name} backend={backend} arch={arch} "
                f"smem={info.shared_memory_per_block // 1024}KB {fields} choice={choice} source={source}")


def active() -> bool:
    """Whether choices are being logged: callers skip building the shape fields when not."""
    return _ENABLED


_FALLBACKS_SEEN: set = set()


def log_fallback(op: str, wanted: str, ran: str, reason: str) -> None:
    """A call that runs slower than it could (a backend or path asked for or expected could not
    serve it) says so once per reason, through the "flash_dma" logger at WARNING, whether or not
    FLASH_DMA_PROFILE is set: a run is never silently slower."""
    key = (op, wanted, ran, reason)
    if key in _FALLBACKS_SEEN:
        return
    _FALLBACKS_SEEN.add(key)
    LOGGER.warning(f"op={op}: {wanted} could not run this call, {ran} runs it instead: {reason}")
