"""The memory estimate against every peak measured on a GPU (benchmarks/results/: the H200's, one H100 call's): a
lower bound that is never above a measurement, so the fit rule refuses only configs that cannot fit, and close to
eager padded runs; and its activation parts against what the census counted autograd saving, part by part."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.plan.layout import sharded_seq_length
from moe_vlm_sweep.plan.memory import (
    ACTIVATION_PARTS,
    GIB,
    activation_parts,
    estimate,
    microbatches_in_flight,
    parameter_counts,
)
from moe_vlm_sweep.plan.plan import make_plan
from moe_vlm_sweep.plan.rules import ConfigError

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _on_gpu(overrides: list[str]) -> bool:
    return any(o.startswith("hardware=") and o != "hardware=cpu" for o in overrides)


COMPILED_FUSIONS_OFF_SINCE = "2026-12-06T05:30:00Z"
"""Runs measured before then ran ``fusions=auto`` with megatron's compiled fusions (bias_dropout, cross_entropy)
on, and the fused loss's fp32 logits are in their peaks: their configs are rebuilt as they ran."""


def _as_ran(overrides: list[str], date: str) -> list[str]:
    if date >= COMPILED_FUSIONS_OFF_SINCE or any(o.startswith("fusions=") for o in overrides):
        return overrides
    given = {o.split("=", 1)[0] for o in overrides}
    return [*overrides, *(f"{k}=true" for k in ("fusions.bias_dropout", "fusions.cross_entropy") if k not in given)]


def _listed_runs(document: dict) -> list[dict]:
    """The runs of ``compare_configs.py`` and ``memory_table.py`` (a list, each run with its overrides) and those of
    ``kernel_wall.py`` (per loop, the loop's overrides beside them) that recorded their peak memory; the plain
    loop's bare runs record none."""
    runs = document.get("runs", [])
    if isinstance(runs, list):
        return runs
    return [
        {**run, "config": f"{loop}{i}", "overrides": document["overrides"][loop]}
        for loop, loop_runs in runs.items()
        for i, run in enumerate(loop_runs, 1)
        if "peak_memory_gib" in run
    ]


def _gpu_runs() -> list[tuple[str, dict]]:
    """Every successful GPU run in the results' JSON."""
    rows = []
    for path in sorted(RESULTS.rglob("*.json")):
        document = json.loads(path.read_text())
        for run in _listed_runs(document) if isinstance(document, dict) else []:
            if run.get("status") == "ok" and _on_gpu(run["overrides"]):
                run = {**run, "overrides": _as_ran(run["overrides"], document.get("date", ""))}
                rows.append((f"{path.relative_to(RESULTS).with_suffix('')}:{run['config']}", run))
    return rows


MEASURED = [(name, run["overrides"], run["peak_memory_gib"]) for name, run in _gpu_runs()]
CENSUSES = [
    (name, run["overrides"], run["saved_activations_gib"], run["microbatches_in_flight"])
    for name, run in _gpu_runs()
    if "saved_activations_gib" in run
]


def test_kernel_wall_runs_are_read_with_their_loops_overrides():
    """``kernel_wall.py`` stores runs per loop and the overrides once per loop; the bare plain loop records no
    memory, so only the best config's runs are held to the estimate."""
    document = {
        "overrides": {"plain": ["batch.mbs=32"], "best": ["batch.mbs=96"]},
        "runs": {"plain": [{"status": "ok"}], "best": [{"status": "ok", "peak_memory_gib": 70.0}, {"status": "oom"}]},
    }
    assert _listed_runs(document) == [
        {"status": "ok", "peak_memory_gib": 70.0, "config": "best1", "overrides": ["batch.mbs=96"]}
    ]
    assert _listed_runs({"runs": [{"config": "a"}]}) == [{"config": "a"}]


def test_the_results_hold_gpu_measurements():
    assert len(MEASURED) >= 15


@pytest.mark.parametrize("name,overrides,measured", MEASURED, ids=[m[0] for m in MEASURED])
def test_estimate_is_a_close_lower_bound_of_the_measured_peak(name, overrides, measured):
    cfg = compose_run_config(overrides)
    predicted = estimate(cfg).total_gib
    assert predicted <= measured, f"{name}: estimate {predicted:.1f} GiB above the measured {measured:.1f} GiB"
    # CUDA-graph pools are not modelled, and a packed row is bounded by the data's shortest samples: only the
    # bound holds there
    if cfg.cuda_graph.impl == "none" and not cfg.data.packing:
        assert predicted >= 0.85 * measured, f"{name}: estimate {predicted:.1f} GiB, measured {measured:.1f} GiB"


def test_the_results_hold_gpu_censuses_of_every_recompute_kind():
    kinds = {compose_run_config(overrides).recompute.granularity for _, overrides, _, _ in CENSUSES}
    assert kinds == {"none", "selective", "full"}


@pytest.mark.parametrize("name,overrides,saved,in_flight", CENSUSES, ids=[c[0] for c in CENSUSES])
def test_each_activation_part_is_a_close_lower_bound_of_the_gpu_census(name, overrides, saved, in_flight):
    """Part by part, the formula stays at or below what autograd saved on the H200 and within 10% of it (the
    census counts every micro-batch in flight)."""
    cfg = compose_run_config(overrides)
    assert microbatches_in_flight(cfg) == in_flight
    parts = activation_parts(cfg, sharded_seq_length(cfg))
    for part in ACTIVATION_PARTS:
        predicted, measured = in_flight * parts[part] / GIB, saved[part]
        assert predicted <= measured + 1e-3, f"{name} {part}: estimate {predicted:.2f} GiB above {measured:.2f}"
        assert predicted >= 0.9 * measured, f"{name} {part}: estimate {predicted:.2f} GiB, measured {measured:.2f}"


def test_reference_model_has_its_documented_size():
    counts = parameter_counts(compose_run_config(["model=small"]).model)
    assert 0.78e9 < sum(vars(counts).values()) < 0.81e9  # "the 0.8B reference" (796M)


def test_sharding_divides_static_memory():
    one = estimate(compose_run_config(["model=small", "hardware=h200", "parallel=3d"])).static_gib
    eight = estimate(
        compose_run_config(
            [
                "model=small",
                "hardware=h200",
                "parallel=3d",
                "launcher=torchrun",
                "launcher.nproc_per_node=8",
                "batch.gbs=8",
            ]
        )
    ).static_gib
    sharded = estimate(
        compose_run_config(
            ["model=small", "hardware=h200", "launcher=torchrun", "launcher.nproc_per_node=8", "batch.gbs=8"]
        )
    ).static_gib
    assert eight < one / 2  # the distributed optimizer shards 12 of 18 bytes per parameter over DP=8
    assert sharded < eight  # Megatron-FSDP optim_grads_params shards weights and gradients too


def test_a_model_that_cannot_fit_is_refused_before_launch():
    with pytest.raises(ConfigError, match=r"needs at least \d+\.\d GiB per GPU .* hardware.memory_gib=139.8"):
        make_plan(compose_run_config(["model=qwen3_vl_30b_a3b", "hardware=h200"]))


@pytest.mark.parametrize(
    "pp, vpp, gbs, expected",
    [
        (1, 1, 16, 1),
        (2, 1, 16, 2),
        (2, 1, 1, 1),  # 1F1B: up to pp micro-batches, never more than the step has
        (2, 2, 16, 2.5),  # interleaved: 2 (pp-1) + (vpp-1) pp + 1 = 5 chunks of half a stage
        (2, 2, 2, 2),  # ... capped by the step's 2 micro-batches x 2 chunks
    ],
)
def test_micro_batches_in_flight_follow_megatrons_schedules(pp, vpp, gbs, expected):
    from moe_vlm_sweep.plan.memory import microbatches_in_flight

    cfg = compose_run_config(
        [
            "model=tiny",
            "parallel=3d",
            f"parallel.pp={pp}",
            f"parallel.vpp={vpp}",
            "launcher=torchrun",
            f"launcher.nproc_per_node={pp}",
            "batch.mbs=1",
            f"batch.gbs={gbs}",
        ]
    )
    assert microbatches_in_flight(cfg) == expected


def test_vision_activations_split_by_tp_except_the_norms():
    """The ViT and projector run the decoder's TP without sequence parallelism: more TP shrinks them, but never
    below their whole norms (an estimate above the real peak would refuse configs that fit)."""

    def vision(tp: int) -> float:
        cfg = compose_run_config(
            [
                "model=small",
                "hardware=h200",
                "parallel=3d",
                f"parallel.tp={tp}",
                f"parallel.sp={tp > 1}",
                "launcher=torchrun",
                f"launcher.nproc_per_node={tp}",
            ]
        )
        return activation_parts(cfg, sharded_seq_length(cfg))["vision_encoder"]

    assert vision(1) / 2 < vision(2) < vision(1)
    assert vision(1) / 4 < vision(4) < vision(2)
