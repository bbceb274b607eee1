"""An out-of-memory the CPU can provoke, through the real worker: its address space capped (``RLIMIT_AS``) just
above what its imports take, a tiny training runs out, and ``failure.json`` says ``oom`` with the memory at the
failure. A runtime error that does not say "memory" (a thread that could not start) counts as ``oom`` only when the
memory state shows the address space used up."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed
from conftest import why_failed

from moe_vlm_sweep.train.oom import memory_state
from moe_vlm_sweep.train.worker import classify

_CAPPED_WORKER = textwrap.dedent(
    """
    import resource, sys
    import psutil
    from moe_vlm_sweep.train import worker
    for module in worker.PRELOAD:
        __import__(module)
    used = psutil.Process().memory_info().vms
    resource.setrlimit(resource.RLIMIT_AS, (used + (256 << 20), resource.RLIM_INFINITY))
    sys.exit(worker.main(["worker", sys.argv[1]]))
    """
)


def test_a_worker_that_runs_out_of_address_space_fails_as_oom_with_its_memory(run_cli, tmp_path):
    code, run_dir = run_cli("model=tiny", "train.steps=1", "train.warmup_steps=0", "train.profile_steps=0")
    assert code == 0, why_failed(run_dir)
    (run_dir / "metrics.json").unlink()
    proc = subprocess.run(
        [sys.executable, "-c", _CAPPED_WORKER, str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["failure_class"] == "oom", (failure["exception_type"], failure["message"], failure["memory"])
    memory = failure["memory"]
    assert memory["address_space_limit_gib"] > 0 and memory["rss_gib"] > 0 and memory["peak_rss_gib"] > 0
    assert "gpu_free_gib" not in memory  # a CPU run has no GPU state
    assert not (run_dir / "metrics.json").exists()


_THREAD_UNDER_CAP = textwrap.dedent(
    """
    import json, resource, threading
    import psutil
    from moe_vlm_sweep.train.oom import memory_state
    from moe_vlm_sweep.train.worker import classify
    classify(RuntimeError("warm"), memory_state())  # its lazy imports, before the cap
    resource.setrlimit(resource.RLIMIT_AS, (psutil.Process().memory_info().vms + (4 << 20), resource.RLIM_INFINITY))
    try:
        threading.Thread(target=lambda: None).start()
        print(json.dumps({"started": True}))
    except RuntimeError as exc:
        memory = memory_state()
        print(json.dumps({"message": str(exc), "class": classify(exc, memory), "memory": memory,
                          "class_without_memory": classify(exc)}))
    """
)


def test_a_thread_that_cannot_start_for_lack_of_address_space_is_oom():
    proc = subprocess.run([sys.executable, "-c", _THREAD_UNDER_CAP], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "started" not in seen, "a thread's stack still fit under the cap"
    assert "memory" not in seen["message"].lower()  # its words alone do not say so ("can't start new thread")
    assert seen["class_without_memory"] == "crash"
    assert seen["class"] == "oom", seen


def test_the_same_runtime_error_with_memory_to_spare_stays_a_crash():
    assert classify(RuntimeError("can't start new thread"), memory_state()) == "crash"
    assert (
        classify(
            RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling cublasCreate(handle)"), memory_state()
        )
        == "crash"
    )  # no GPU state here: nothing says memory was used up


_NCCL_UNHANDLED = (
    "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function failed."
)
_CUBLAS_CREATE = "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"


def _gpu(free_gib: float, total_gib: float = 79.1) -> dict:
    return {**memory_state(), "gpu": 0, "gpu_free_gib": free_gib, "gpu_total_gib": total_gib}


@pytest.mark.parametrize(
    ("exc", "free_gib", "expected"),
    [
        (torch.distributed.DistBackendError(_NCCL_UNHANDLED), 0.3, "oom"),  # NCCL's buffers on a full card
        (torch.distributed.DistBackendError(_NCCL_UNHANDLED), 30.0, "crash"),  # the same words, memory to spare
        (RuntimeError(_CUBLAS_CREATE), 0.01, "oom"),  # cuBLAS's handle on a full card
        (RuntimeError(_CUBLAS_CREATE), 30.0, "crash"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), 0.01, "crash"),  # a kernel's fault
        (IndexError("index 7 is out of bounds for dimension 0 with size 4"), 0.01, "crash"),  # not the CUDA stack
    ],
    ids=["nccl_full", "nccl_spare", "cublas_full", "cublas_spare", "illegal_access_full", "index_full"],
)
def test_a_cuda_library_error_is_oom_when_the_gpu_had_no_memory_left(exc, free_gib, expected):
    assert classify(exc, _gpu(free_gib)) == expected
