"""The worker's preflight: the checks that need the machine a run landed on (a GPU, Transformer Engine, APEX,
DeepEP, the cuDNN runtime, FP8 support, the world size torchrun gave), run before anything is built, so a plan
this machine cannot run fails at once as ``invalid`` with the knob, its value and what is missing. The
config-only rules are ``plan/rules.py``; the machine-fact rules ``check`` can preview are ``machine_rules.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import platform

import torch

from moe_vlm_sweep.model import wgrad_fusion
from moe_vlm_sweep.plan.plan import RunPlan

GRADIENT_ACCUMULATION_NEEDS_APEX = (
    "fusions.gradient_accumulation=true with megatron's own layers (train.transformer_impl='local') needs APEX's "
    "fused_weight_gradient_mlp_cuda extension, which is not importable here: megatron's linear layers fuse the "
    "weight-gradient accumulation only through it (megatron/core/tensor_parallel/layers.py: "
    "ColumnParallelLinear.__init__, `if config.gradient_accumulation_fusion and not _grad_accum_fusion_available: "
    "raise RuntimeError`). Transformer Engine's layers fuse it themselves (train.transformer_impl="
    "'transformer_engine'). Install APEX with --cpp_ext --cuda_ext, or set fusions.gradient_accumulation=false"
)
"""Why the fusion is rejected without APEX where no layer is TE's; with TE layers, they alone fuse it
(``model/build.py``: ``fuse_wgrad_accumulation_in_te_layers``)."""
GRADIENT_ACCUMULATION_TE_UNDER_FSDP = (
    "fusions.gradient_accumulation=true with parallel=fsdp and no APEX: only TE's layers would fuse it, and "
    "Megatron-FSDP has them overwrite main_grad rather than add to it (param.overwrite_main_grad, "
    "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py), a path whose gradients across "
    "micro-batches are not checked here. Use parallel=3d, or set fusions.gradient_accumulation=false"
)


class PreflightError(RuntimeError):
    """The machine cannot run this plan as asked (failure class ``invalid``)."""


def preflight(plan: RunPlan) -> None:
    """Machine-dependent checks; each message names the knob, its value and what is missing."""
    cfg, problems = plan.run_config, []
    if plan.device == "cuda" and not torch.cuda.is_available():
        problems.append(
            f"hardware.device='cuda' needs a CUDA GPU, but torch.cuda.is_available() is False on "
            f"{platform.node()} (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
    if plan.device == "cpu" and cfg.cuda_graph.impl != "none":
        problems.append(f"cuda_graph.impl={cfg.cuda_graph.impl!r} needs a CUDA GPU; hardware.device is 'cpu'")
    needs: list[tuple[str, str, str | None]] = []
    if plan.transformer_impl == "transformer_engine":
        needs.append((f"train.transformer_impl={plan.transformer_impl!r}", "transformer_engine", None))
    if wgrad_fusion.fused_layers(plan, wgrad_fusion.apex_built()) == "needs_apex":
        te_layers = plan.transformer_impl == "transformer_engine"
        problems.append(GRADIENT_ACCUMULATION_TE_UNDER_FSDP if te_layers else GRADIENT_ACCUMULATION_NEEDS_APEX)
    if cfg.dispatcher.token_dispatcher == "flex":
        attr = "HybridEPBuffer" if cfg.dispatcher.flex_backend == "hybridep" else None
        needs.append(
            (
                f"dispatcher.token_dispatcher='flex' with dispatcher.flex_backend={cfg.dispatcher.flex_backend!r}",
                "deep_ep",
                attr,
            )
        )
    for knob, package, attr in needs:
        try:
            module = importlib.import_module(package)
            if attr is not None and not hasattr(module, attr):
                problems.append(f"{knob} needs {package}.{attr}, which this {package} build lacks")
        except ImportError as exc:
            problems.append(f"{knob} needs the {package} package, which is not importable here: {exc}")
    if plan.transformer_impl == "transformer_engine" and plan.device == "cuda" and not problems:
        from transformer_engine.pytorch.utils import get_cudnn_version

        from moe_vlm_sweep.train.machine_rules import graphs_unfuse_attention, packing_unfuses_attention

        major, minor, patch = get_cudnn_version()
        flash_attn = importlib.util.find_spec("flash_attn") is not None
        for machine_rule in (graphs_unfuse_attention, packing_unfuses_attention):
            if message := machine_rule(cfg, major * 10000 + minor * 100 + patch, flash_attn):
                problems.append(message)
        if plan.fp8_recipe and torch.cuda.is_available():
            problems.extend(_fp8_support(plan.fp8_recipe))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.layout.world_size:
        problems.append(
            f"the plan's layout needs world_size={plan.layout.world_size} processes "
            f"(launcher.nproc_per_node * launcher.nnodes), but WORLD_SIZE={world}"
        )
    if problems:
        raise PreflightError("; ".join(problems))


def _fp8_support(fp8_recipe: str) -> list[str]:
    """TE's own verdict on this GPU and CUDA for the recipe (``transformer_engine.pytorch.is_fp8_available``,
    ``is_fp8_block_scaling_available``): FP8 needs compute capability 9.0 (or 8.9 with CUDA 12.1), block scaling
    also CUDA 12.9."""
    import transformer_engine.pytorch as te

    checks = [te.is_fp8_available]
    if fp8_recipe == "blockwise":
        checks.append(te.is_fp8_block_scaling_available)
    problems = []
    for check in checks:
        ok, reason = check(return_reason=True)
        if not ok:
            problems.append(
                f"train.precision=fp8 with train.fp8_recipe={fp8_recipe}: Transformer Engine refuses it on "
                f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}): {reason}"
            )
    return problems
