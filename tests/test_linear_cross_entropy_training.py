"""A run with the fused linear cross-entropy trains like a run without it: one process, and TP=2 with SP (the
vocabulary-parallel path) under torchrun."""

from __future__ import annotations

import pytest
from conftest import read_json, why_failed


def _losses(run_cli, *overrides: str) -> list[float]:
    code, run_dir = run_cli("model=tiny", "train.steps=3", "train.warmup_steps=1", "train.profile_steps=0", *overrides)
    assert code == 0, why_failed(run_dir)
    return read_json(run_dir / "metrics.json")["loss"]["values"]


def test_a_run_with_the_fusion_trains_like_one_without(run_cli):
    plain = _losses(run_cli)
    fused = _losses(run_cli, "fusions.linear_cross_entropy=true")
    assert fused == pytest.approx(plain, rel=1e-4)


@pytest.mark.slow
def test_vocabulary_parallel_under_tp2_with_sp(run_cli):
    layout = ["launcher=torchrun", "launcher.nproc_per_node=2", "parallel=3d", "parallel.tp=2", "parallel.sp=true"]
    plain = _losses(run_cli, *layout)
    fused = _losses(run_cli, *layout, "fusions.linear_cross_entropy=true")
    assert fused == pytest.approx(plain, rel=1e-4)
