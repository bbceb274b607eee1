"""The recipe/performance table covers every config field; the fingerprint follows the recipe only."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from moe_vlm_sweep.config import recipe
from moe_vlm_sweep.config.compose import compose_config, to_run_config
from moe_vlm_sweep.config.recipe import KNOBS, Knob, leaf_fields
from moe_vlm_sweep.config.schema import BatchConf, DispatcherConf, RunConfig, VisionTrainingConf
from moe_vlm_sweep.plan.plan import make_plan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_every_field_of_every_group_is_classified():
    """Walks the dataclasses: a field added to any group without a kind here fails, as does a stale entry."""
    fields = list(leaf_fields(RunConfig))
    assert len(fields) > 80
    assert sorted(set(fields) - set(KNOBS)) == []
    assert sorted(set(KNOBS) - set(fields)) == []
    assert all(isinstance(k, Knob) for k in KNOBS.values())


@pytest.mark.parametrize(
    "path,expected",
    [
        ("vision", Knob.RECIPE),
        ("model", Knob.RECIPE),
        ("dispatcher", Knob.RECIPE),
        ("batch.gbs", Knob.RECIPE),
        ("batch.mbs", Knob.PERFORMANCE),
        ("parallel", Knob.PERFORMANCE),
        ("cuda_graph", Knob.PERFORMANCE),
        ("data.packing", Knob.PERFORMANCE),
        ("train.lr", Knob.RECIPE),
        ("recompute", Knob.PERFORMANCE),
    ],
)
def test_kind_of_a_field_or_a_group(path, expected):
    assert recipe.kind(path) is expected


def test_the_fingerprint_moves_with_recipe_fields_only():
    base = RunConfig()
    same = dataclasses.replace(base, batch=BatchConf(mbs=1, gbs=4))
    assert recipe.fingerprint(same) == recipe.fingerprint(base)  # MBS at a fixed GBS: performance
    for changed in (
        dataclasses.replace(base, vision=VisionTrainingConf(name="trainable", freeze_encoder=True)),
        dataclasses.replace(base, dispatcher=DispatcherConf(capacity_factor=1.0, pad_to_capacity=True)),
        dataclasses.replace(base, batch=BatchConf(mbs=2, gbs=8)),
    ):
        assert recipe.fingerprint(changed) != recipe.fingerprint(base)


def test_the_plan_carries_the_fingerprint_and_what_differs_from_the_model():
    def plan(*overrides: str):
        return make_plan(to_run_config(compose_config(list(overrides))))

    frozen = plan("model=small", "vision=frozen", "model.text_tokens=1089")
    assert frozen.recipe["fingerprint"] == recipe.fingerprint(frozen.run_config)
    assert frozen.recipe["differs"] == {
        "model.text_tokens": 1089,
        "vision.name": "frozen",
        "vision.freeze_encoder": True,
        "vision.freeze_projector": True,
    }
    assert plan("model=small", "parallel=3d", "batch.mbs=1").recipe["differs"] == {}


def test_the_fingerprint_reads_precision_as_trained():
    """``auto`` is the device's dtype, and an FP8 scaling recipe is part of the recipe only where FP8 runs."""

    def cfg(*overrides: str) -> RunConfig:
        return to_run_config(compose_config(["model=small", *overrides]))

    def fp(*overrides: str) -> str:
        return recipe.fingerprint(cfg(*overrides))

    assert fp("hardware=h100") == fp("hardware=h100", "train.precision=bf16")
    assert fp("hardware=h100") != fp("hardware=h100", "train.precision=fp32")
    assert (
        fp("hardware=cpu") == fp("hardware=cpu", "train.precision=fp32") != fp("hardware=cpu", "train.precision=bf16")
    )
    assert fp("hardware=h100", "train.fp8_recipe=blockwise") == fp("hardware=h100")  # no FP8 runs
    fp8 = fp("hardware=h100", "train.precision=fp8", "train.fp8_recipe=tensorwise")
    assert fp8 != fp("hardware=h100") and fp8 != fp(
        "hardware=h100", "train.precision=fp8", "train.fp8_recipe=blockwise"
    )
    # a GPU run of the model's defaults differs from them in nothing; its FP8 sibling in the FP8 fields
    assert recipe.summary(cfg("hardware=h100"))["differs"] == {}
    assert recipe.summary(cfg("hardware=h100", "train.precision=fp8"))["differs"] == {"train.precision": "fp8"}


def test_runs_that_kept_their_defaults_keep_their_fingerprints():
    """The committed H100 proxy runs (bf16 as ``train.precision=auto``, and two FP8 recipes) as fingerprinted
    when they ran."""
    runs = json.loads((RESULTS / "h100_proxy_fp8" / "fp8.json").read_text())["runs"]
    assert len(runs) == 3
    for run in runs:
        assert recipe.fingerprint(to_run_config(compose_config(run["overrides"]))) == run["recipe"]["fingerprint"]


def test_a_steps_global_batch_is_the_same_samples_under_any_layout():
    """Each sample is drawn by its index in the global batch, so dp and mbs change who computes it, not what."""
    from moe_vlm_sweep.config.schema import DataConf, ModelConf
    from moe_vlm_sweep.data import make_source

    def global_batch(mbs: int, dp: int, gbs: int = 8, step: int = 3) -> list[tuple]:
        rows = []
        for rank in range(dp):
            source = make_source(ModelConf(), DataConf(), micro_batch_size=mbs, dp_rank=rank, dp_size=dp)
            for mb in source.step(step, gbs // (mbs * dp)):
                rows += [(tuple(ids.tolist()), float(img.sum())) for ids, img in zip(mb.input_ids, mb.images)]
        return sorted(rows)

    reference = global_batch(mbs=2, dp=1)
    assert len(set(reference)) == 8
    assert global_batch(mbs=1, dp=2) == global_batch(mbs=4, dp=2) == global_batch(mbs=8, dp=1) == reference
    assert global_batch(mbs=2, dp=1, step=4) != reference


def test_check_prints_the_fingerprint_and_what_differs(capsys):
    from moe_vlm_sweep.cli import main

    assert main(["check", "vision=frozen_encoder", "batch.gbs=8"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("recipe"))
    fingerprint = recipe.fingerprint(to_run_config(compose_config(["vision=frozen_encoder", "batch.gbs=8"])))
    assert line.split()[1] == fingerprint
    assert "batch.gbs=8" in line and "vision.freeze_encoder=True" in line and "freeze_projector" not in line
