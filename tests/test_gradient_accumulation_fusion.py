"""``fusions.gradient_accumulation`` without APEX: rejected by the worker's preflight with megatron-core's reason,
which these tests hold against megatron-core itself (TE's layers alone would run it; the output layer does not)."""

from __future__ import annotations

import importlib.util
import inspect

import pytest

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.plan.plan import make_plan

needs_no_apex = pytest.mark.skipif(
    importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
    reason="APEX's fused_weight_gradient_mlp_cuda is installed here, so the fusion is not rejected",
)


@needs_no_apex
def test_preflight_refuses_it_naming_megatrons_check():
    from moe_vlm_sweep.train.worker import GRADIENT_ACCUMULATION_NEEDS_APEX, PreflightError, preflight

    plan = make_plan(compose_run_config(["hardware=h100", "fusions.gradient_accumulation=true"]))
    with pytest.raises(PreflightError) as rejected:
        preflight(plan)
    assert GRADIENT_ACCUMULATION_NEEDS_APEX in str(rejected.value)
    assert "megatron/core/tensor_parallel/layers.py: ColumnParallelLinear.__init__" in str(rejected.value)


def test_the_output_layer_is_megatrons_column_parallel_linear_on_hopper():
    """What the refusal says of GPTModel: its output layer is TE's only with the Blackwell mxfp8 output projection."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    source = inspect.getsource(GPTModel.__init__)
    assert "TELMHeadColumnParallelLinear\n                if is_mxfp8_output_proj_active(config)" in source
    assert "else tensor_parallel.ColumnParallelLinear" in source


@needs_no_apex
def test_megatrons_column_parallel_linear_raises_without_apex(megatron_world):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from moe_vlm_sweep.model.build import decoder_config

    plan = make_plan(compose_run_config(["fusions.gradient_accumulation=true"]), validate=False)
    config = decoder_config(plan)
    assert config.gradient_accumulation_fusion
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion set to True but the custom CUDA extension"):
        ColumnParallelLinear(
            config.hidden_size, 64, config=config, init_method=config.init_method, bias=False, gather_output=False
        )
