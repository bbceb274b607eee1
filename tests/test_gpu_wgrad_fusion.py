"""``fusions.gradient_accumulation`` on a real GPU without APEX: TE's layers accumulate their weight gradients into
DDP's fp32 ``main_grad`` in their own GEMM, megatron's output layer unfused, and the model trains as without it.

Skipped on machines without CUDA and Transformer Engine (CI), with that reason; run on the GPU machine with
``python -m pytest tests/test_gpu_wgrad_fusion.py``. The product's own ``verify`` judges it: the fused run against
the unfused one on the same batches and seeds, to the tolerance the unfused run's spread against itself measures,
in the loss and in the gradient norm, which a gradient counted twice (TE's accumulation and DDP's hook both adding
it) or lost would move while Adam's update hid it from the loss.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import GPU_TINY, needs_cuda_te

from moe_vlm_sweep.export.verify import verify
from moe_vlm_sweep.model import wgrad_fusion

pytestmark = needs_cuda_te


def test_te_honours_the_switch_set_after_construction():
    """What ``fuse_wgrad_accumulation_in_te_layers`` relies on: a TE layer built without the fusion and switched on
    afterwards adds each backward's weight gradient into ``main_grad`` and marks it, instead of returning it."""
    import transformer_engine.pytorch as te

    torch.manual_seed(0)
    fused = te.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    plain = te.Linear(64, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    plain.weight.data.copy_(fused.weight.data)
    fused.fuse_wgrad_accumulation = True
    fused.weight.main_grad = torch.zeros_like(fused.weight, dtype=torch.float32)
    expected = torch.zeros_like(fused.weight, dtype=torch.float32)
    for _ in range(2):
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
        fused.weight.grad_added_to_main_grad = False
        fused(x).float().square().sum().backward()
        plain(x).float().square().sum().backward()
        assert fused.weight.grad_added_to_main_grad
        expected += plain.weight.grad.float()
        plain.weight.grad = None
    # the plain layer returns each weight gradient in bf16 (8 bits of mantissa) before the fp32 sum, the fused one
    # accumulates in fp32: they agree to bf16 rounding of the largest entries
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.skipif(
    wgrad_fusion.apex_built(),
    reason="APEX is built here: megatron's flag fuses every layer, TE's alone are not the path under test",
)
def test_te_layers_fuse_the_weight_gradient_and_train_as_without_it(tmp_path):
    verdict = verify(
        [*GPU_TINY, "fusions.gradient_accumulation=true"],
        [*GPU_TINY, "fusions.gradient_accumulation=false"],
        steps=5,
        out_dir=tmp_path,
    )
    assert verdict.status != "error", verdict.reason
    log = (Path(verdict.run_dirs["candidate"] or "") / "worker.log").read_text()
    assert "TE's weight-gradient fusion in" in log, log[-3000:]
    assert int(log.split("TE's weight-gradient fusion in ")[1].split()[0]) > 0
    assert verdict.grad_norm is not None and len(verdict.grad_norm.steps) == 5
    assert verdict.passed, verdict.summary()
