"""``fusions.gradient_accumulation`` without APEX: TE's layers fuse it themselves, megatron's own do not. The model is
built with megatron's flag off (its output layer would raise) and TE's layers get TE's own switch; with no TE layer
(``train.transformer_impl=local``) the worker's preflight rejects it with megatron-core's reason, which these tests
hold against megatron-core itself. ``tests/test_gpu_wgrad_fusion.py`` trains with it on a GPU."""

from __future__ import annotations

import inspect

import pytest

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.model import wgrad_fusion
from moe_vlm_sweep.plan.plan import make_plan

needs_no_apex = pytest.mark.skipif(
    wgrad_fusion.apex_built(), reason="APEX's fused_weight_gradient_mlp_cuda is installed here, so it is not rejected"
)


@needs_no_apex
def test_preflight_rejects_it_with_megatrons_own_layers_naming_megatrons_check():
    from moe_vlm_sweep.train.preflight import GRADIENT_ACCUMULATION_NEEDS_APEX, PreflightError, preflight

    overrides = ["hardware=h100", "train.transformer_impl=local", "fusions.gradient_accumulation=true"]
    plan = make_plan(compose_run_config(overrides))
    with pytest.raises(PreflightError) as rejected:
        preflight(plan)
    assert GRADIENT_ACCUMULATION_NEEDS_APEX in str(rejected.value)
    assert "megatron/core/tensor_parallel/layers.py: ColumnParallelLinear.__init__" in str(rejected.value)


def _preflight_problems(overrides: list[str]) -> str:
    """What the preflight rejects the plan for here ("" if nothing: a GPU machine with TE)."""
    from moe_vlm_sweep.train.preflight import PreflightError, preflight

    try:
        preflight(make_plan(compose_run_config(overrides)))
    except PreflightError as exc:
        return str(exc)
    return ""


@needs_no_apex
def test_preflight_lets_te_layers_fuse_it_without_apex_in_3d_only():
    from moe_vlm_sweep.train.preflight import (
        GRADIENT_ACCUMULATION_NEEDS_APEX,
        GRADIENT_ACCUMULATION_TE_UNDER_FSDP,
    )

    common = ["hardware=h100", "fusions.gradient_accumulation=true"]
    plan = make_plan(compose_run_config([*common, "parallel=3d"]))
    assert plan.transformer_impl == "transformer_engine" and plan.fusions["gradient_accumulation"]
    in_3d = _preflight_problems([*common, "parallel=3d"])
    assert GRADIENT_ACCUMULATION_NEEDS_APEX not in in_3d and GRADIENT_ACCUMULATION_TE_UNDER_FSDP not in in_3d
    assert GRADIENT_ACCUMULATION_TE_UNDER_FSDP in _preflight_problems([*common, "parallel=fsdp"])


@pytest.mark.parametrize(
    ("overrides", "note"),
    [
        (["parallel=3d"], "only TE's layers fuse it and the output layer accumulates unfused"),
        (["parallel=fsdp"], "needs APEX's fused_weight_gradient_mlp_cuda where it runs"),
        (["parallel=3d", "train.transformer_impl=local"], "train.transformer_impl='local'"),
        (["parallel=3d", "fusions.gradient_accumulation=false"], None),
    ],
)
def test_check_says_in_advance_what_the_fusion_will_need(overrides, note, capsys):
    """``check`` runs without the GPU machine, so it cannot know whether APEX is built there: it says what the
    worker's preflight will do either way, on the fusions row."""
    from moe_vlm_sweep.cli import main

    assert main(["check", "hardware=h100", "fusions.gradient_accumulation=true", *overrides]) == 0
    fusions_row = next(line for line in capsys.readouterr().out.splitlines() if "fusions" in line.split(":")[0])
    assert (note in fusions_row) if note else "gradient_accumulation:" not in fusions_row


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
    assert not config.gradient_accumulation_fusion  # so the output layer builds: TE's layers get the fusion alone
    ColumnParallelLinear(
        config.hidden_size, 64, config=config, init_method=config.init_method, bias=False, gather_output=False
    )
    config.gradient_accumulation_fusion = True
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion set to True but the custom CUDA extension"):
        ColumnParallelLinear(
            config.hidden_size, 64, config=config, init_method=config.init_method, bias=False, gather_output=False
        )
