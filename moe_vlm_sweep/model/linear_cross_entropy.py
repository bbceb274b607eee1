"""The output projection fused with the cross-entropy loss, chunked over tokens: the whole logits never exist.

Megatron's loss takes the output layer's logits for the whole micro-batch ([tokens, vocab / TP] in bf16) and, in
its unfused form, an fp32 copy of them; at ``model=small``'s vocabulary of 32768 and 100k tokens a micro-batch
that is 6.5 GiB of bf16 and 13 GiB of fp32, and the elementwise passes over them are a tenth of the step's
kernel time. This op computes the logits one chunk of tokens at a time (``plan.memory.linear_ce_chunk_tokens``),
keeps only each token's log-sum-exp for backward, and in backward recomputes each chunk's logits to form
``softmax - onehot`` and both gradients. The price is one more GEMM of the output layer's size; the saving is the
logits' memory and their fp32 passes. It is the loss megatron computes (``vocab_parallel_cross_entropy``: the
same per-token loss, labels outside the vocabulary shard contribute nothing to the shard's gradient), so the
recipe is unchanged; ``tests/test_linear_cross_entropy.py`` holds it to megatron's loss and gradients.

Vocabulary-parallel under TP: the hidden states enter through megatron's own TP regions (gathered from the
sequence-parallel region under SP, copied into the TP region otherwise, whose backward reduces the hidden
gradient), and the log-sum-exp and the target logit are all-reduced over the TP group, as megatron's loss does.

It hooks in through ``GPTModel``'s ``output_processor`` (its documented custom-postprocess argument), which
LLaVA does not pass, so a forward pre-hook on the language model adds it (``install``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from moe_vlm_sweep.plan.memory import linear_ce_chunk_tokens

if TYPE_CHECKING:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear


def _gpu_kernels(hidden: torch.Tensor):
    """The Triton kernels for a CUDA tensor (``linear_cross_entropy_kernels``), else None: plain torch ops."""
    if not hidden.is_cuda:
        return None
    from moe_vlm_sweep.model import linear_cross_entropy_kernels

    return linear_cross_entropy_kernels


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss of ``hidden @ weight.T`` against ``labels`` over a vocabulary shard ``[start, start+V)``."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        tp_group: Any,
        chunk: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        vocab = weight.shape[0]
        kernels = _gpu_kernels(hidden)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 statistics for bf16 logits
        local = labels - vocab_start
        in_shard = (local >= 0) & (local < vocab)
        local = torch.where(in_shard, local, torch.zeros_like(local))
        maxes = torch.empty(n, dtype=acc, device=hidden.device)
        sums = torch.empty_like(maxes)
        picked = torch.empty_like(maxes)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logits = torch.matmul(hidden[lo:hi], weight.t())
            picked[lo:hi] = logits.gather(1, local[lo:hi, None]).squeeze(1).to(acc)
            if kernels is not None:
                maxes[lo:hi], sums[lo:hi] = kernels.max_and_sum(logits)
            else:
                logits = logits.to(acc)
                m = logits.max(dim=-1).values
                maxes[lo:hi] = m
                sums[lo:hi] = torch.exp(logits - m[:, None]).sum(dim=-1)
            del logits
        tp = tp_group is not None and dist.get_world_size(tp_group) > 1
        if tp:
            global_max = maxes.clone()
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
            sums *= torch.exp(maxes - global_max)
            dist.all_reduce(sums, group=tp_group)
            maxes = global_max
        # As megatron's loss: the target's max-shifted logit from the one shard holding it (none for an ignored
        # label, whose loss is then log-sum-exp minus the max: a value the loss mask drops)
        target = torch.where(in_shard, picked - maxes, torch.zeros_like(picked))
        if tp:
            dist.all_reduce(target, group=tp_group)
        lse = maxes + torch.log(sums)
        ctx.save_for_backward(hidden, weight, local, in_shard, lse)
        ctx.chunk = chunk
        return lse - maxes - target

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, weight, local, in_shard, lse = ctx.saved_tensors
        n, chunk = hidden.shape[0], ctx.chunk
        kernels = _gpu_kernels(hidden)
        grad_loss = grad_loss.to(lse.dtype).contiguous()
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device)
        rows = torch.arange(chunk, device=hidden.device)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            logits = torch.matmul(hidden[lo:hi], weight.t())
            if kernels is not None:
                grad_logits = kernels.grad_in_place(logits, lse[lo:hi], local[lo:hi], in_shard[lo:hi], grad_loss[lo:hi])
            else:
                probs = logits.to(lse.dtype).sub_(lse[lo:hi, None]).exp_()
                probs[rows[: hi - lo], local[lo:hi]] -= in_shard[lo:hi].to(lse.dtype)
                grad_logits = probs.mul_(grad_loss[lo:hi, None]).to(hidden.dtype)
                del probs
            del logits
            grad_hidden[lo:hi] = torch.matmul(grad_logits, weight)
            grad_weight.add_(torch.matmul(grad_logits.t(), hidden[lo:hi]).to(lse.dtype))
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, sequence_parallel: bool
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` from decoder hidden states ``[s, b, h]`` (``[s/TP, b, h]`` under SP) and labels
    ``[b, s]``, the shape and values ``LanguageModule.compute_language_model_loss`` returns."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    if tp > 1:
        hidden = (
            gather_from_sequence_parallel_region(hidden, group=tp_group)
            if sequence_parallel
            else copy_to_tensor_model_parallel_region(hidden, group=tp_group)
        )
    s, b, h = hidden.shape
    flat_hidden = hidden.reshape(s * b, h)
    flat_labels = labels.transpose(0, 1).reshape(s * b)
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    loss = _LinearCrossEntropy.apply(
        flat_hidden, weight, flat_labels, vocab_start, tp_group, linear_ce_chunk_tokens(weight.shape[0])
    )
    return loss.reshape(s, b).transpose(0, 1).contiguous()


def _output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: ColumnParallelLinear,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    runtime_gather_output: bool | None = None,
    **_: Any,
) -> torch.Tensor:
    """``GPTModel._postprocess``'s hook: the fused loss when there are labels, the layer's logits otherwise."""
    if labels is None:
        logits, _bias = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()
    weight = output_weight if output_weight is not None else output_layer.weight
    return linear_cross_entropy(hidden_states, weight, labels, sequence_parallel=output_layer.sequence_parallel)


def _add_output_processor(_module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    kwargs["output_processor"] = _output_processor
    return args, kwargs


def install(language_model: torch.nn.Module) -> None:
    """Route ``language_model``'s (a ``GPTModel`` on the last pipeline stage) loss through the fused op."""
    if getattr(language_model, "post_process", False):
        language_model.register_forward_pre_hook(_add_output_processor, with_kwargs=True)
