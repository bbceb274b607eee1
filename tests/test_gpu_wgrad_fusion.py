"""``fusions.gradient_accumulation`` on a real GPU without APEX: TE's layers accumulate their weight gradients into
DDP's fp32 ``main_grad`` in their own GEMM, megatron's output layer unfused, and the model trains as without it.

Skipped on machines without CUDA and Transformer Engine (CI), with that reason; run on the GPU machine with
``python -m pytest tests/test_gpu_wgrad_fusion.py``. Same data and seed in both runs: the losses agree to bf16
noise, and so do the gradient norms, which a gradient counted twice (TE's accumulation and DDP's hook both adding
it) would double while Adam's update hid it from the loss.
"""

from __future__ import annotations

import pytest
import torch
from conftest import GPU_TINY, needs_cuda_te, read_json, run_in

from moe_vlm_sweep.model import apex

pytestmark = needs_cuda_te

COMMON = (
    *GPU_TINY,
    "train.warmup_steps=2",
    "train.steps=5",
    "train.profile_steps=0",
    "data.fixed_batch=true",
)


def _run(outputs, *overrides: str) -> tuple[dict, str]:
    code, run_dir = run_in(outputs, *COMMON, *overrides)
    assert run_dir is not None
    log = (run_dir / "worker.log").read_text()
    assert code == 0, log[-4000:]
    return read_json(run_dir / "metrics.json"), log


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
    torch.testing.assert_close(fused.weight.main_grad, expected, rtol=2e-2, atol=1e-2)


@pytest.mark.skipif(
    apex.wgrad_fusion_built(),
    reason="APEX is built here: megatron's flag fuses every layer, TE's alone are not the path under test",
)
def test_te_layers_fuse_the_weight_gradient_and_train_as_without_it(tmp_path):
    unfused, _ = _run(tmp_path / "unfused", "fusions.gradient_accumulation=false")
    fused, log = _run(tmp_path / "fused", "fusions.gradient_accumulation=true")
    assert "TE's weight-gradient fusion in" in log
    layers = int(log.split("TE's weight-gradient fusion in ")[1].split()[0])
    assert layers > 0
    assert fused["loss"]["values"] == pytest.approx(unfused["loss"]["values"], rel=2e-2)
    assert fused["loss"]["grad_norms"] == pytest.approx(unfused["loss"]["grad_norms"], rel=5e-2)
