"""Which layers fuse ``fusions.gradient_accumulation`` (a layer's weight-gradient GEMM accumulating into DDP's fp32
``main_grad`` itself) on a machine with or without APEX's CUDA extension: one rule, read by the model builder, the
worker's preflight and ``check``'s note.

megatron-core sets the fusion with one flag for the whole model, and its own linear layers (the output layer,
``ColumnParallelLinear``) raise without APEX's ``fused_weight_gradient_mlp_cuda``. Transformer Engine's layers fuse
it with their own GEMM, so without APEX the model is built with megatron's flag off and TE's layers get TE's switch
(``model/build.py``). Megatron-FSDP has TE overwrite ``main_grad`` rather than add to it, a path not checked here.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from moe_vlm_sweep.plan.plan import RunPlan

FusedLayers = Literal["off", "every_layer", "te_layers", "needs_apex"]
"""``off``: the fusion is not asked for. ``every_layer``: APEX is built, megatron's flag fuses every layer.
``te_layers``: TE's layers alone fuse it, the output layer accumulates unfused. ``needs_apex``: no layer can
(no TE layer, or Megatron-FSDP): the worker's preflight rejects the plan."""


def apex_built() -> bool:
    """Whether ``fused_weight_gradient_mlp_cuda`` is importable: megatron's own linear layers need it for
    ``gradient_accumulation_fusion`` (``megatron/core/tensor_parallel/layers.py``); TE's layers do not."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def fused_layers(plan: RunPlan, apex: bool) -> FusedLayers:
    """Which layers of ``plan``'s model fuse the weight-gradient accumulation where APEX is (``apex``) or is not
    built."""
    if not plan.fusions["gradient_accumulation"]:
        return "off"
    if apex:
        return "every_layer"
    if plan.transformer_impl == "transformer_engine" and plan.run_config.parallel.strategy != "fsdp":
        return "te_layers"
    return "needs_apex"
