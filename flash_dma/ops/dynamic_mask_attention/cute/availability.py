"""Whether the CuTe DSL backend can run on a device, and if not, why.

Nothing here imports the CuTe stack at module import: the base install (Triton only) pays nothing.
The stack is imported the first time a status is asked for a Hopper device, and the answer is
cached per device for the life of the process.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata

import torch

INSTALL_HINT = 'pip install "flash-dma[hopper]"'

# The versions this backend was written and tested against. flash-attn-4 is a beta whose private
# entry points (flash_attn.cute.interface._flash_attn_fwd / _flash_attn_bwd) change between
# releases, so it must match exactly; nvidia-cutlass-dsl must match in major.minor.
FLASH_ATTN_4_VERSION = "4.0.0b36"
CUTLASS_DSL_SERIES = "4.8"
# CuTe kernels here are written for SM90 (H100, H200): wgmma and TMA as Hopper has them.
# Blackwell (10.x) runs other kernels in FA4 that this backend has not validated.
SUPPORTED_CAPABILITY = (9, 0)


class CuteBackendUnavailable(RuntimeError):
    """FLASH_DMA_BACKEND=cute was asked for where the CuTe backend cannot run."""


def cute_backend_status(device) -> str | None:
    """None when the CuTe backend can run on `device`; otherwise one sentence saying why not and
    how to get it. Cheap after the first call per device."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the CuTe backend runs on CUDA GPUs, and the tensors are on {device}"
    if device.index is not None:
        return _cuda_status(device.index)
    if not torch.cuda.is_available():
        return "the CuTe backend needs a CUDA GPU, and torch sees none"
    return _cuda_status(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_status(index: int) -> str | None:
    if not torch.cuda.is_available():
        return "the CuTe backend needs a CUDA GPU, and torch sees none"
    capability = torch.cuda.get_device_capability(index)
    if tuple(capability) != SUPPORTED_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return (f"the CuTe backend is written for SM90 (H100/H200, compute capability 9.0); "
                f"cuda:{index} is {name} with compute capability {capability[0]}.{capability[1]}")
    return software_status()


@functools.lru_cache(maxsize=None)
def software_status() -> str | None:
    """None when the CuTe DSL stack at the tested versions is importable (device not checked)."""
    problems = []
    cutlass_version = _installed_version("nvidia-cutlass-dsl")
    fa4_version = _installed_version("flash-attn-4")
    if cutlass_version is None:
        problems.append("nvidia-cutlass-dsl is not installed")
    elif not (cutlass_version == CUTLASS_DSL_SERIES or cutlass_version.startswith(CUTLASS_DSL_SERIES + ".")):
        problems.append(f"nvidia-cutlass-dsl {cutlass_version} is installed, "
                        f"the backend needs {CUTLASS_DSL_SERIES}.x")
    if fa4_version is None:
        problems.append("flash-attn-4 is not installed")
    elif fa4_version != FLASH_ATTN_4_VERSION:
        problems.append(f"flash-attn-4 {fa4_version} is installed, the backend needs "
                        f"exactly {FLASH_ATTN_4_VERSION} (it calls entry points that change between betas)")
    if not problems:
        for module in ("cutlass", "cutlass.cute", "flash_attn.cute.interface"):
            failure = _import_failure(module)
            if failure is not None:
                problems.append(f"importing {module} failed ({failure})")
                break
    if not problems:
        return None
    return "; ".join(problems) + f". Install the Hopper extra: {INSTALL_HINT}"


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _import_failure(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken install raises more than ImportError (OSError from its libraries)
        return f"{type(exc).__name__}: {exc}"
    return None


def require_cute(device) -> None:
    """Raise CuteBackendUnavailable, saying why and how to install, unless the backend can run."""
    status = cute_backend_status(device)
    if status is None:
        return
    how = "" if INSTALL_HINT in status else f". It needs an SM90 GPU (H100/H200) and {INSTALL_HINT}"
    raise CuteBackendUnavailable(f"FLASH_DMA_BACKEND=cute, but {status}{how}. Unset "
                                 "FLASH_DMA_BACKEND (or set it to auto or triton) to run the Triton backend.")
