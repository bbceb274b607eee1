"""On a CUDA device the fused linear cross-entropy runs Triton kernels for its elementwise passes: they must give
the plain torch path's losses and gradients (the path the CPU tests hold to megatron's loss), in bf16.

Skipped on machines without CUDA (CI), with that reason; run on a GPU machine with
``python -m pytest tests/test_gpu_linear_cross_entropy.py``."""

from __future__ import annotations

import pytest
import torch

from moe_vlm_sweep.model import linear_cross_entropy as lce

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; CI has none")


def _loss_and_grads(hidden, weight, labels, upstream, chunk):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = lce._LinearCrossEntropy.apply(hidden, weight, labels, 0, None, chunk)
    (loss * upstream).sum().backward()
    return loss, hidden.grad, weight.grad


@pytest.mark.parametrize("vocab", [32768, 5000])  # a multiple of the kernels' block, and a ragged one
def test_kernels_match_the_torch_path(monkeypatch, vocab):
    torch.manual_seed(0)
    n, h = 3000, 256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, h, device="cuda", dtype=torch.bfloat16) * 0.05
    labels = torch.randint(0, vocab, (n,), device="cuda")
    labels[:100] = -100
    upstream = torch.rand(n, device="cuda")
    fast = _loss_and_grads(hidden, weight, labels, upstream, chunk=1024)
    monkeypatch.setattr(lce, "_gpu_kernels", lambda _hidden: None)
    plain = _loss_and_grads(hidden, weight, labels, upstream, chunk=1024)
    torch.testing.assert_close(fast[0], plain[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(fast[1:], plain[1:]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-3)
