"""Whether APEX's CUDA extension for megatron's fused weight-gradient accumulation is built on this machine."""

from __future__ import annotations

import importlib.util


def wgrad_fusion_built() -> bool:
    """Whether ``fused_weight_gradient_mlp_cuda`` is importable: megatron's own linear layers need it for
    ``gradient_accumulation_fusion`` (``megatron/core/tensor_parallel/layers.py``); TE's layers do not."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
