"""Overlapped data-parallel communication trains the same model: two data-parallel ranks, with megatron's
gradient-reduce and parameter-gather overlap on, give the losses of the same run with them off (3D and FSDP)."""

from __future__ import annotations

import pytest
from conftest import read_json, why_failed

OVERLAP = ("parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true")


def _losses(run_cli, *overrides: str) -> list[float]:
    code, run_dir = run_cli(
        "model=tiny",
        "launcher=torchrun",
        "launcher.nproc_per_node=2",
        "batch.mbs=1",
        "batch.gbs=4",
        "train.steps=3",
        "train.warmup_steps=1",
        "train.profile_steps=0",
        *overrides,
    )
    assert code == 0, why_failed(run_dir)
    return read_json(run_dir / "metrics.json")["loss"]["values"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["3d", "fsdp"])
def test_overlapped_communication_trains_like_the_plain_reduction(run_cli, strategy):
    plain = _losses(run_cli, f"parallel={strategy}")
    overlapped = _losses(run_cli, f"parallel={strategy}", *OVERLAP)
    assert overlapped == pytest.approx(plain, rel=1e-5)


def test_the_knobs_reach_megatrons_wrapper_and_schedule(megatron_world):
    """The flags land in the DDP config and the schedule gets megatron's sync functions (without them the pipeline
    schedules would reduce after every micro-batch)."""
    from moe_vlm_sweep.config.compose import compose_run_config
    from moe_vlm_sweep.model.build import build_model_chunks
    from moe_vlm_sweep.plan.plan import make_plan
    from moe_vlm_sweep.train.loop import wrap_for_training

    for overlap in (False, True):
        flags = [f"parallel.overlap_grad_reduce={overlap}", f"parallel.overlap_param_gather={overlap}"]
        plan = make_plan(compose_run_config(["model=tiny", "parallel=3d", *flags]))
        models, _ = wrap_for_training(plan, build_model_chunks(plan))
        config = models[0].config
        assert models[0].ddp_config.overlap_grad_reduce is overlap
        assert models[0].ddp_config.overlap_param_gather is overlap
        assert (config.no_sync_func == models[0].no_sync) is overlap
        assert (config.grad_sync_func == models[0].start_grad_sync) is overlap
