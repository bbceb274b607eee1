"""On a CUDA GPU, another process holding memory on the trial's GPU while it measures is named in ``metrics.json``
(its pid and the memory it held, read through NVML or nvidia-smi), and the trial's own process never is. Skipped
without CUDA. Run on a GPU machine: ``PYTHONPATH=$PWD python -m pytest -q tests/test_gpu_contention.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ok_run, run_in

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_TINY_ON_GPU = (
    "model=tiny",
    "hardware=h100",
    "train.transformer_impl=local",
    "fusions=off",
    "train.steps=4",
    "train.profile_steps=0",
)


def test_another_process_on_the_trials_gpu_is_named_and_the_trial_itself_is_not(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, torch\nx = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:0')\n"
            "print('held', flush=True)\nsys.stdin.read()\n",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_in(tmp_path / "shared", *_TINY_ON_GPU)
    finally:
        holder.kill()
        holder.wait()
    _, metrics = ok_run(result)
    contention = metrics["contention"]
    assert contention["gpu_source"] in ("nvml", "nvidia-smi"), contention
    seen = {p["pid"]: p for p in contention["processes"]}
    assert metrics["contended"] is True and holder.pid in seen, contention
    assert seen[holder.pid]["where"].startswith("gpu GPU-")
    assert seen[holder.pid]["gpu_memory_mib"] is None or seen[holder.pid]["gpu_memory_mib"] >= 1024

    _, metrics = ok_run(run_in(tmp_path / "alone", *_TINY_ON_GPU))
    assert metrics["contended"] is False, metrics["contention"]  # its own CUDA context is not "another process"
