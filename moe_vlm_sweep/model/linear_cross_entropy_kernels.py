"""The fused linear cross-entropy's elementwise work on a GPU: one Triton kernel a pass over a chunk's logits.

Per chunk of tokens, forward reads the bf16 logits once for each token's max and sum of exponentials (online, in
fp32), and backward turns the recomputed bf16 logits into their gradient in place, ``(softmax - onehot) * g``, in
one read and one write. Unfused, the same work is a dozen fp32 passes over an fp32 copy. ``linear_cross_entropy``
uses these where Triton and CUDA are present and the plain torch ops (the reference the tests hold these to)
elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _max_and_sum_kernel(logits, stride, maxes, sums, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        m = m_new
    row_max = tl.max(m, axis=0)
    row_sum = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - row_max)), axis=0)
    tl.store(maxes + row, row_max)
    tl.store(sums + row, row_sum)


@triton.jit
def _grad_in_place_kernel(logits, stride, lse, target, hit, grad_loss, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    row_lse = tl.load(lse + row)
    g = tl.load(grad_loss + row)
    t = tl.load(target + row)
    h = tl.load(hit + row).to(tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
        p = tl.exp(x - row_lse) - tl.where(cols == t, h, 0.0)
        tl.store(base + cols, (p * g).to(logits.dtype.element_ty), mask=valid)


def max_and_sum(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and sum of ``exp(x - max)``, in fp32, from ``logits`` [rows, vocab] in one pass."""
    rows, vocab = logits.shape
    maxes = torch.empty(rows, dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    _max_and_sum_kernel[(rows,)](logits, logits.stride(0), maxes, sums, vocab, BLOCK=_BLOCK, num_warps=8)
    return maxes, sums


def grad_in_place(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, hit: torch.Tensor, grad_loss: torch.Tensor
) -> torch.Tensor:
    """Overwrite ``logits`` with ``(softmax - onehot(target if hit)) * grad_loss`` per row; return it."""
    rows, vocab = logits.shape
    _grad_in_place_kernel[(rows,)](
        logits, logits.stride(0), lse, target, hit, grad_loss, vocab, BLOCK=_BLOCK, num_warps=8
    )
    return logits
