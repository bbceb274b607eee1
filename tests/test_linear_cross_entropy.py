"""The fused linear cross-entropy is megatron's loss: the same per-token losses and gradients, in any chunking;
its memory bound drops the logits. (Training runs with it: ``test_linear_cross_entropy_training.py``, apart from
this module's in-process megatron world.)"""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from moe_vlm_sweep.model import linear_cross_entropy as lce
from moe_vlm_sweep.plan import memory


@pytest.mark.parametrize("chunk_bytes", [4 * 64 * 7, 2**29])  # 7 tokens a chunk (ragged last chunk), or one chunk
def test_losses_and_gradients_equal_megatrons(megatron_world, monkeypatch, chunk_bytes):
    monkeypatch.setattr(memory, "LINEAR_CE_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(lce, "linear_ce_chunk_tokens", memory.linear_ce_chunk_tokens)
    torch.manual_seed(0)
    s, b, h, vocab = 9, 3, 16, 64
    hidden = torch.randn(s, b, h, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    labels[0, :4] = -100  # LLaVA's ignored positions (image tokens): megatron gives them a loss the mask drops
    upstream = torch.rand(b, s)

    fused = lce.linear_cross_entropy(hidden, weight, labels, sequence_parallel=False)
    (fused * upstream).sum().backward()
    fused_grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = torch.einsum("sbh,vh->sbv", hidden, weight)
    reference = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)
    (reference * upstream).sum().backward()

    assert fused.shape == (b, s)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grads[1], weight.grad, rtol=1e-5, atol=1e-5)


def test_the_memory_bound_drops_the_logits_with_the_fusion():
    from moe_vlm_sweep.config.compose import compose_run_config

    args = [
        "model=small",
        "hardware=h100",
        "parallel=3d",
        "batch.mbs=64",
        "batch.gbs=192",
        "fusions.cross_entropy=false",
    ]
    plain = compose_run_config(args)
    fused = compose_run_config([*args, "fusions.linear_cross_entropy=true"])
    tokens = 64 * 1599
    logits_fp32 = 4 * tokens * plain.model.decoder.vocab_size
    assert memory._output_bytes(plain, tokens, 2) - memory._output_bytes(fused, tokens, 2) == pytest.approx(
        logits_fp32 - 4 * tokens
    )
    assert memory.transient_bytes(fused, 1599) < 0.2 * memory.transient_bytes(plain, 1599)
    assert fused.fusions.resolved(on_gpu=True)["cross_entropy"] is False
