"""Is a failure an out-of-memory? Judged from the error (how each library words it) and the memory at the failure.

An out-of-memory is a property of the config (the sampler learns to avoid it), whichever library met it first: the
same packed MBS failed inside NCCL on an H100 (``DistBackendError ... Failed to CUDA calloc async 24 bytes``) and
was counted as a crash. Libraries do not always say so: under memory pressure cuBLAS reports
``CUBLAS_STATUS_NOT_INITIALIZED`` from ``cublasCreate`` and NCCL an ``unhandled cuda error``. So the worker
records :func:`memory_state` in ``failure.json`` and a CUDA-library error raised while the GPU had almost no free
memory (or a runtime error on the CPU with its address space or RAM used up) counts as ``oom`` too.
"""

from __future__ import annotations

import resource
from typing import Any

import psutil

OOM_MESSAGES = (
    "out of memory",  # torch.OutOfMemoryError, "CUDA error: out of memory", NCCL's "Cuda failure 'out
    # of memory'", TE's and cuDNN frontend's wording
    "failed to cuda calloc",  # NCCL allocating its buffers: "Failed to CUDA calloc async 24 bytes"
    "cudaerrormemoryallocation",  # the CUDA runtime's name (TE's checks, NCCL's "unhandled cuda error" details)
    "cuda_error_out_of_memory",  # the driver API's name (TE's cuda-python and NVRTC paths)
    "cublas_status_alloc_failed",  # a cuBLAS workspace
    "cudnn_status_alloc_failed",  # a cuDNN workspace
    "can't allocate memory",  # PyTorch's CPU allocator (DefaultCPUAllocator)
)
"""How each library says it ran out of memory, lower case."""

CUDA_LIBRARY_WORDS = ("cuda", "nccl", "cublas", "cudnn", "transformer_engine", "cutlass")
"""An error naming one of these came from the CUDA stack, where an allocation failure may be worded as anything."""

KERNEL_FAULTS = ("illegal memory access", "device-side assert", "misaligned address", "illegal instruction")
"""CUDA errors that are a kernel's fault, never an allocation's: a crash even on a full card."""

LOW_FREE_FRACTION = 0.02
"""Memory counts as used up when less than this share of it is free (of the GPU; of RAM on the CPU) or the
process's address space is this close to its ``RLIMIT_AS``: a config that leaves 2% of an 80 GB card free is
already at the allocator's fragmentation limit."""

_GIB = 2**30


def memory_state() -> dict[str, Any]:
    """The memory at the failure, in GiB: the process (RSS, peak RSS, address space and its limit) and RAM, and
    when CUDA was started its GPU (torch's allocated and reserved, their peaks, the device's free and total)."""
    state: dict[str, Any] = {}
    try:  # reading memory can itself fail when none is left: the failure is still written, with what was read
        process = psutil.Process().memory_info()
        ram = psutil.virtual_memory()
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        state |= {
            "rss_gib": process.rss / _GIB,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / _GIB,
            "address_space_gib": process.vms / _GIB,
            "address_space_limit_gib": None if limit == resource.RLIM_INFINITY else limit / _GIB,
            "ram_available_gib": ram.available / _GIB,
            "ram_total_gib": ram.total / _GIB,
        }
    except Exception as exc:
        state["error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import torch

        if torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            free, total = torch.cuda.mem_get_info(device)
            state |= {
                "gpu": device,
                "gpu_allocated_gib": torch.cuda.memory_allocated(device) / _GIB,
                "gpu_reserved_gib": torch.cuda.memory_reserved(device) / _GIB,
                "gpu_max_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
                "gpu_max_reserved_gib": torch.cuda.max_memory_reserved(device) / _GIB,
                "gpu_free_gib": free / _GIB,
                "gpu_total_gib": total / _GIB,
            }
    except Exception as exc:  # a broken CUDA context: say so
        state["gpu_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return state


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and all(exc is not s for s in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def says_out_of_memory(exc: BaseException) -> bool:
    """True if ``exc`` or an exception it was raised from is an out-of-memory by its type or :data:`OOM_MESSAGES`."""
    import torch

    return any(
        isinstance(e, (torch.OutOfMemoryError, MemoryError)) or any(m in str(e).lower() for m in OOM_MESSAGES)
        for e in _chain(exc)
    )


def memory_used_up(memory: dict[str, Any]) -> str | None:
    """Which memory was used up at the failure (``gpu``, ``address space``, ``ram``), or None."""
    if memory.get("gpu_total_gib") and memory["gpu_free_gib"] < LOW_FREE_FRACTION * memory["gpu_total_gib"]:
        return "gpu"
    limit = memory.get("address_space_limit_gib")
    if limit and memory["address_space_gib"] > (1 - LOW_FREE_FRACTION) * limit:
        return "address space"
    if memory.get("ram_total_gib") and memory["ram_available_gib"] < LOW_FREE_FRACTION * memory["ram_total_gib"]:
        return "ram"
    return None


def is_out_of_memory(exc: BaseException, memory: dict[str, Any] | None = None) -> bool:
    """An out-of-memory by its words, or a library's error while the memory it needs was used up: on the GPU an
    error of the CUDA stack (:data:`CUDA_LIBRARY_WORDS`), on the CPU a runtime or OS error (a thread or a buffer
    that could not be created)."""
    if says_out_of_memory(exc):
        return True
    used_up = memory_used_up(memory or {})
    if used_up is None:
        return False
    chain = _chain(exc)
    if used_up == "gpu":
        said = [f"{type(e).__name__} {e}".lower() for e in chain]
        if any(fault in text for fault in KERNEL_FAULTS for text in said):
            return False
        return any(word in text for word in CUDA_LIBRARY_WORDS for text in said)
    return any(isinstance(e, (RuntimeError, OSError)) for e in chain)
