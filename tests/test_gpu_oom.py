"""Every GPU out-of-memory is ``oom``, provoked for real on one CUDA GPU: torch's allocator, NCCL creating its
communicator, cuBLAS creating its handle and Transformer Engine's GEMM, each in a fresh process whose GPU memory
was first filled (so each library meets a full card; 80 GB or 141 GB alike), and each judged by the worker's
classifier from the real exception and ``memory_state()``. Then the real worker, on a GPU another process holds,
fails with ``failure.json`` saying ``oom`` and its memory. Skipped without CUDA.

Run on a GPU machine: ``PYTHONPATH=$PWD python -m pytest -q tests/test_gpu_oom.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import run_in

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_FILL = """
import json, os, socket, sys, torch
from moe_vlm_sweep.train.oom import memory_state
from moe_vlm_sweep.train.worker import classify
classify(RuntimeError("warm"), None)  # the classifier's lazy imports, before the card is full

def fill():
    held, size = [], 1 << 30
    while size >= 1 << 20:
        try:
            held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            size //= 2
    return held

def report(exc):
    memory = memory_state()
    print(json.dumps({"type": type(exc).__name__, "message": str(exc)[-600:], "class": classify(exc, memory),
                      "memory": memory}))
    sys.exit(0)
"""

_SCENARIOS = {
    "torch": """
held = fill()
try:
    torch.empty(1 << 34, dtype=torch.uint8, device="cuda")
except Exception as exc:
    report(exc)
""",
    "nccl": """
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.ones(1024, device="cuda")
held = fill()
try:
    dist.all_reduce(x)  # the communicator is created here, its buffers on a full card
    torch.cuda.synchronize()
except Exception as exc:
    report(exc)
""",
    "cublas": """
a = torch.ones(256, 256, device="cuda")
held = fill()
try:
    (a @ a).sum().item()  # the first GEMM creates the cuBLAS handle and its workspace
except Exception as exc:
    report(exc)
""",
    "transformer_engine": """
import transformer_engine.pytorch as te
layer = te.Linear(1024, 1024, params_dtype=torch.bfloat16)
x = torch.ones(64, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
held = fill()
try:
    layer(x).sum().backward()
    torch.cuda.synchronize()
except Exception as exc:
    report(exc)
""",
}


def _provoke(name: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_FILL) + textwrap.dedent(_SCENARIOS[name])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]},
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, f"{name}: no exception caught (rc {proc.returncode})\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("library", list(_SCENARIOS))
def test_each_librarys_out_of_memory_on_a_full_card_is_oom(library):
    if library == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        pytest.fail("Transformer Engine is not installed on this GPU machine: its out-of-memory path is untested")
    seen = _provoke(library)
    print(library, seen["type"], seen["message"][-300:])
    memory = seen["memory"]
    assert memory["gpu_total_gib"] > 0 and memory["gpu_reserved_gib"] > 0.5 * memory["gpu_total_gib"], memory
    assert seen["class"] == "oom", seen


def test_the_worker_on_a_card_another_process_fills_fails_as_oom_with_its_memory(tmp_path):
    """A filler holds all but ~1 GiB of the GPU; the real worker's tiny run meets a full card wherever it first
    allocates (CUDA context, NCCL, the model, cuBLAS) and must end ``oom`` with its memory state."""
    filler = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch\n"
            "held = []\n"
            "while torch.cuda.mem_get_info()[0] > (2 << 30):\n"
            "    held.append(torch.empty(1 << 28, dtype=torch.uint8, device='cuda'))\n"
            "print('full', flush=True)\n"
            "sys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert filler.stdout.readline().strip() == "full"
        code, run_dir = run_in(
            tmp_path,
            "model=small",
            "hardware=h100",
            "train.transformer_impl=local",
            "fusions=off",
            "batch.mbs=8",
            "batch.gbs=8",
            "train.steps=2",
            "train.profile_steps=0",
        )
    finally:
        filler.kill()
        filler.wait()
    assert run_dir is not None and code != 0
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["failure_class"] == "oom", (failure["exception_type"], failure["message"][-1000:])
    assert failure["memory"].get("gpu_total_gib", 0) > 0 or "gpu_error" in failure["memory"], failure["memory"]
