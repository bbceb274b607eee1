"""Every out-of-memory is ``oom``, whichever library met it. The CPU allocator's is provoked for real; the GPU
libraries' are their messages as those libraries raise them (NCCL's as seen on an H100)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed

from moe_vlm_sweep.train.worker import classify


def test_a_real_cpu_allocation_failure_is_oom():
    with pytest.raises(RuntimeError) as raised:
        torch.empty(1 << 60, dtype=torch.uint8)
    assert classify(raised.value) == "oom", str(raised.value)


@pytest.mark.parametrize(
    "exc",
    [
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"
        ),
        torch.distributed.DistBackendError(
            "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error (run with "
            "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function failed.\n"
            "Last error:\nFailed to CUDA calloc async 24 bytes"
        ),
        torch.distributed.DistBackendError(
            "NCCL error: unhandled cuda error, NCCL version 2.21.5\nLast error:\nCuda failure 'out of memory'"
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
        RuntimeError(
            "/workspace/TransformerEngine/transformer_engine/common/util/cuda_runtime.cpp:145 in function "
            "get_workspace: CUDA Error: cudaErrorMemoryAllocation"
        ),
        RuntimeError("transformer_engine/common/util/rtc.cpp:210 CUDA driver error: CUDA_ERROR_OUT_OF_MEMORY"),
        RuntimeError("CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."),
    ],
    ids=[
        "torch",
        "nccl_calloc",
        "nccl_cuda_failure",
        "cublas_workspace",
        "cudnn_workspace",
        "te_runtime",
        "te_driver",
        "cuda_runtime",
    ],
)
def test_each_librarys_out_of_memory_is_oom(exc):
    assert classify(exc) == "oom"


def test_an_out_of_memory_under_another_exception_is_oom():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("forward_backward_func failed on micro-batch 3") from inner
    except RuntimeError as outer:
        assert classify(outer) == "oom"


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("index 7 is out of bounds for dimension 0 with size 4"),
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        ValueError("memory"),
    ],
)
def test_other_failures_stay_crashes(exc):
    assert classify(exc) == "crash"
