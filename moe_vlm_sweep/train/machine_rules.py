"""The checks that need a fact of the machine a run lands on (the cuDNN runtime, flash-attn installed), which only
the worker's preflight (``train/preflight.py``) knows. The config-only rule table is ``plan/rules.py``; these take the
machine fact as an argument, so they stay pure and are tested like the rules, and ``check`` can say in advance
what the preflight will require (:func:`preflight_notes`).
"""

from __future__ import annotations

import math

from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.model import wgrad_fusion
from moe_vlm_sweep.plan.layout import seq_padding_factor, sharded_seq_length
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.plan.rules import uses_te


def _cudnn(version: int) -> str:
    """A cuDNN version as TE and cudnnGetVersion encode it (91501), as people write it (9.15.1)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


CUDNN_GRAPHED_ATTENTION_FIX = 91501
"""The cuDNN runtime (9.15.1, encoded as TE and cudnnGetVersion do) from which TE keeps fused attention inside
CUDA-graph capture whatever the sequence length (``nvte_get_fused_attn_backend``, TE 2.20)."""


def graphs_unfuse_attention(cfg: RunConfig, cudnn_version: int, flash_attn: bool = False) -> str | None:
    """Not a registered rule: the worker's preflight passes the runtime cuDNN and whether flash-attn is installed.
    With cuDNN <= 9.15.0, TE refuses fused attention while a graph is captured unless every (SBHD, non-padding) KV
    length it checks is a multiple of 128. Without CP it then silently runs unfused attention: on the H200 0.47-0.63x
    the eager step and 1.9x its memory (benchmarks/results/h200_graphs_cudnn/), a trap, not a config worth
    measuring; flash-attn, where installed, would take over instead. With CP, TE checks each ring step (KV chunks
    down to seq / (2 cp)) and has no other backend, so the capture fails. The length TE checks is the one LLaVA
    pads for SP and CP, and the fix it suggests is a text length whose padded sequence is a multiple."""
    g, cp, seq = cfg.cuda_graph, cfg.parallel.cp, sharded_seq_length(cfg)
    graphs_attention = g.impl in ("local", "transformer_engine") and (not g.modules or "attn" in g.modules)
    multiple = 128 if cp == 1 else 256 * cp
    if (
        not graphs_attention
        or not uses_te(cfg)
        or cudnn_version >= CUDNN_GRAPHED_ATTENTION_FIX
        or seq % multiple == 0
        or (cp == 1 and flash_attn)
    ):
        return None
    factor = seq_padding_factor(cfg)
    step = math.lcm(multiple, factor)
    fixed = -(-cfg.model.seq_length // step) * step  # the padded length to reach; padding adds up to factor - 1
    text_tokens = cfg.model.text_tokens + max(0, fixed - factor + 1 - cfg.model.seq_length)
    version = _cudnn(cudnn_version)
    if cp == 1:
        lengths = f"{seq} decoder tokens" + (
            f", {cfg.model.seq_length} padded for SP" if seq != cfg.model.seq_length else ""
        )
        effect = "runs unfused attention instead (about half the eager speed, twice the memory)"
    else:
        lengths, effect = (
            f"parallel.cp={cp} ring chunks of {seq} decoder tokens, down to {seq / (2 * cp):g}",
            "has no other attention backend under context parallelism, so the capture fails",
        )
    return (
        f"cuda_graph={g.scope} graphs decoder attention, but with cuDNN {version} (<= 9.15.0) TE refuses fused "
        f"attention under graph capture for a KV length that is not a multiple of 128 ({lengths}) and {effect}: "
        f"set model.text_tokens={text_tokens} ({fixed} decoder tokens{' as padded' if factor > 1 else ''}), "
        "graph no attention "
        "(cuda_graph=none), or upgrade cuDNN to 9.15.1+"
    )


CUDNN_THD = {True: 90600, False: 90100}
"""The cuDNN runtime from which TE's fused attention takes THD rows on sm90, with GQA (True) or without: below it
TE 2.20 falls back to unfused attention, which pads the row back to [mbs, max_seqlen] and scores it whole."""


def packing_unfuses_attention(cfg: RunConfig, cudnn_version: int, flash_attn: bool = False) -> str | None:
    """Not a registered rule: the worker's preflight passes the runtime cuDNN and whether flash-attn (whose varlen
    kernels take THD too) is installed. A packed run on an unfused fallback would measure the fallback, not
    packing, and may not fit: at MBS 96 the scores alone take gigabytes per layer."""
    d = cfg.model.decoder
    gqa = d.num_query_groups < d.num_attention_heads
    needed = CUDNN_THD[gqa]
    if not cfg.data.packing or not uses_te(cfg) or flash_attn or cudnn_version >= needed:
        return None
    return (
        f"data.packing=true runs THD attention, which TE's fused attention takes from cuDNN {_cudnn(needed)}"
        f"{' with GQA' if gqa else ''}; with cuDNN {_cudnn(cudnn_version)} TE falls back to unfused attention "
        "over the row padded back to [mbs, max_seqlen]: upgrade cuDNN, install flash-attn, or data.packing=false"
    )


def preflight_notes(plan: RunPlan) -> dict[str, str]:
    """Per row of ``plan.describe``, what the worker's preflight will require of the machine: ``check`` runs
    without the GPU and cannot know its cuDNN, nor whether APEX is built there."""
    cfg, notes = plan.run_config, {}
    if graphs_unfuse_attention(cfg, CUDNN_GRAPHED_ATTENTION_FIX - 1):
        notes["cuda_graph"] = (
            "needs cuDNN >= 9.15.1 where it runs, since the sequence is not a multiple of 128 (the worker's "
            "preflight checks)"
        )
    fused = wgrad_fusion.fused_layers(plan, apex=False)
    if fused != "off":
        notes["fusions"] = (
            "gradient_accumulation: where APEX's fused_weight_gradient_mlp_cuda is not built, only TE's layers fuse "
            "it and the output layer accumulates unfused"
            if fused == "te_layers"
            else "gradient_accumulation: needs APEX's fused_weight_gradient_mlp_cuda where it runs, with "
            f"train.transformer_impl={plan.transformer_impl!r} and parallel={cfg.parallel.strategy} (the worker's "
            "preflight checks)"
        )
    return notes
