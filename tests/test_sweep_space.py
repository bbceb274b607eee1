"""Search-space parsing (pure functions) and the shipped spaces, on real Optuna (in memory)."""

from __future__ import annotations

import re

import optuna
import pytest

from hydra_plugins.moe_vlm_sweep_sweeper._impl import SweeperImpl
from moe_vlm_sweep.config.compose import CONF_DIR, compose_config
from moe_vlm_sweep.plan.rules import ConfigError
from moe_vlm_sweep.sweep.space import Condition, Space, fingerprint, fixed_overrides, format_value, parse_param
from moe_vlm_sweep.sweep.spec import SweepSpecError, load_spec
from moe_vlm_sweep.sweep.study import study_name
from moe_vlm_sweep.sweep.trial import plan_trial, run_overrides

SPACES = sorted(p.stem for p in (CONF_DIR / "sweep").glob("*.yaml"))


@pytest.mark.parametrize(
    "raw,kind,extra",
    [
        ([1, 2, 4], "categorical", {"choices": (1, 2, 4)}),
        ({"type": "categorical", "choices": [[1, 2], "x"]}, "categorical", {"choices": ("[1,2]", "x")}),
        ({"type": "int", "low": 1, "high": 8, "log": True}, "int", {"low": 1, "high": 8, "log": True}),
        ({"type": "int", "low": 0, "high": 8, "step": 2}, "int", {"step": 2}),
        ({"type": "float", "low": 1e-4, "high": 1e-2, "log": True}, "float", {"log": True}),
        ({"type": "float", "low": 0.0, "high": 1.0, "step": 0.25}, "float", {"step": 0.25}),
    ],
)
def test_parse_param(raw, kind, extra):
    param = parse_param("k", raw, [])
    assert param.kind == kind
    for name, value in extra.items():
        assert getattr(param, name) == value


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"type": "gauss"}, "sweep.params.k.type='gauss' must be categorical, int or float"),
        ({"type": "int", "low": 4, "high": 1}, "sweep.params.k.low=4 must be <= high=1"),
        ({"type": "int", "low": 0, "high": 8, "log": True}, "log=true needs low > 0"),
        ({"type": "int", "low": 1, "high": 8, "log": True, "step": 2}, "no step (got 2)"),
        ({"type": "float", "low": "a", "high": 1}, "sweep.params.k.low='a' must be a number"),
        ({"type": "categorical", "choices": []}, "sweep.params.k.choices must list at least one value"),
        ({"type": "int", "low": 1, "high": 2, "lo": 3}, "unknown field(s) lo"),
        ({"type": "categorical", "choises": [1, 2]}, "sweep.params.k: unknown field(s) choises for type categorical"),
        ({"type": "int", "low": 1, "high": 2, "choices": [1]}, "unknown field(s) choices for type int"),
        ({"type": "int", "low": 1, "high": 2, "when": {"nope": 1}}, "names 'nope', which is not a param listed before"),
    ],
)
def test_parse_param_errors_name_the_knob(raw, message):
    with pytest.raises(
        SweepSpecError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("*", r"\*")
        .replace(".", r"\.")
        .replace("[", r"\["),
    ):
        parse_param("k", raw, [])


@pytest.mark.parametrize(
    "raw,sampled,holds",
    [
        ("3d", {"parallel": "3d"}, True),
        ("3d", {"parallel": "fsdp"}, False),
        (">1", {"parallel.ep": 2}, True),
        (">1", {"parallel.ep": 1}, False),
        ("!=none", {"parallel.ep": "full"}, True),
        ([2, 4], {"parallel.ep": 4}, True),
        ("3d", {}, False),
    ],
)
def test_conditions(raw, sampled, holds):
    key = next(iter(sampled), "parallel")
    param = parse_param("x", {"type": "categorical", "choices": [1], "when": {key: raw}}, [key])
    assert param.when[0].holds(sampled) is holds and isinstance(param.when[0], Condition)


@pytest.mark.parametrize(
    "value,text", [(None, "null"), (True, "true"), ([1, "a"], "[1,a]"), ("3d", "3d"), ("a b", "'a b'"), (1e-3, "0.001")]
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_conditional_params_are_sampled_only_when_their_condition_holds():
    space = Space.parse(
        {
            "parallel": ["fsdp", "3d"],
            "parallel.tp": {"type": "int", "low": 1, "high": 4, "log": True, "when": {"parallel": "3d"}},
            "parallel.ep": [1, 2],
            "parallel.etp": {"type": "categorical", "choices": [1, 2], "when": {"parallel.ep": ">1"}},
            "recompute": ["none", "selective"],
            "recompute.modules": {
                "type": "categorical",
                "choices": [["core_attn"]],
                "when": {"recompute": "selective"},
            },
        }
    )
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = []
    for _ in range(40):
        sampled = space.suggest(study.ask())
        seen.append(sampled)
        assert ("parallel.tp" in sampled) == (sampled["parallel"] == "3d")
        assert ("parallel.etp" in sampled) == (sampled["parallel.ep"] > 1)
        assert ("recompute.modules" in sampled) == (sampled["recompute"] == "selective")
    assert any("parallel.tp" in s for s in seen) and any("parallel.tp" not in s for s in seen)
    assert "recompute.modules=[core_attn]" in Space.overrides({"recompute.modules": "[core_attn]"})


FIRST_SPACE = {
    "parallel": ["fsdp", "3d"],
    "parallel.tp": {"type": "int", "low": 1, "high": 4, "when": {"parallel": "3d"}},
    "recompute.modules": [["core_attn"], ["moe"]],
}


def test_neighbors_move_one_knob_and_follow_the_conditions():
    space = Space.parse(
        {
            "parallel": ["fsdp", "3d"],
            "parallel.fsdp_sharding": {
                "type": "categorical",
                "choices": ["optim_grads_params", "optim_grads"],
                "when": {"parallel": "fsdp"},
            },
            "batch.mbs": {"type": "int", "low": 1, "high": 8, "log": True},
            "parallel.tp": {"type": "int", "low": 1, "high": 4, "when": {"parallel": "3d"}},
            "train.lr": {"type": "float", "low": 1e-4, "high": 1e-2},
        }
    )
    best = {"parallel": "3d", "batch.mbs": 4, "parallel.tp": 1, "train.lr": 1e-3}
    assert space.neighbors(best) == [
        {"parallel": "fsdp", "batch.mbs": 4, "train.lr": 1e-3},  # tp dropped, fsdp_sharding left to the sampler
        {"parallel": "3d", "batch.mbs": 2, "parallel.tp": 1, "train.lr": 1e-3},  # log int: halved and doubled
        {"parallel": "3d", "batch.mbs": 8, "parallel.tp": 1, "train.lr": 1e-3},
        {"parallel": "3d", "batch.mbs": 4, "parallel.tp": 2, "train.lr": 1e-3},  # 0 is below low
    ]  # a continuous float has no neighbor


def test_first_trials_are_checked_against_the_space_and_enqueued_as_given():
    space = Space.parse(FIRST_SPACE)
    point = space.point({"parallel": "3d", "parallel.tp": 2, "recompute.modules": ["moe"]}, "sweep.first_trials[0]")
    assert point == {"parallel": "3d", "parallel.tp": 2, "recompute.modules": "[moe]"}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial(space.point({"parallel": "fsdp"}, "x"))
    sampled = space.suggest(study.ask())
    assert sampled["parallel"] == "fsdp" and "parallel.tp" not in sampled and "recompute.modules" in sampled


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"parallel.pp": 2},
            r"sweep.first_trials\[1\].parallel.pp: not a param of sweep.params \(searched: parallel, ",
        ),
        (
            {"parallel": "ddp"},
            r"sweep.first_trials\[1\].parallel=ddp is not one of sweep.params.parallel.choices "
            r"\[fsdp, 3d\]",
        ),
        ({"parallel": "3d", "parallel.tp": 8}, r"parallel.tp=8 is outside sweep.params.parallel.tp \[1, 4\]"),
        (
            {"parallel": "fsdp", "parallel.tp": 2},
            r"parallel.tp is given, but in this config its condition "
            r"\(parallel == '3d'\) does not hold",
        ),
    ],
)
def test_first_trial_errors_name_the_entry_and_the_rule(values, message):
    with pytest.raises(SweepSpecError, match=message):
        Space.parse(FIRST_SPACE).point(values, "sweep.first_trials[1]")


def test_a_knob_cannot_be_both_searched_and_fixed():
    with pytest.raises(SweepSpecError, match=re.escape("sweep.params.batch.mbs is also set by a fixed override")):
        Space.parse({"batch.mbs": [1, 2]}, fixed_keys=["batch.mbs"])


def test_fingerprint_is_stable_and_sensitive():
    assert fingerprint({"a": [1, 2]}, ["x=1"]) == fingerprint({"a": [1, 2]}, ["x=1"])
    assert fingerprint({"a": [1, 2]}, ["x=1"]) != fingerprint({"a": [1, 2]}, ["x=2"])


def test_spec_errors_name_the_knob():
    with pytest.raises(SweepSpecError, match=re.escape("sweep.n_trials=0 must be >= 1")):
        load_spec({"n_trials": 0})
    with pytest.raises(SweepSpecError, match=re.escape("sweep.objective.direction='up' must be maximize or minimize")):
        load_spec({"objective": {"direction": "up"}})
    with pytest.raises(SweepSpecError, match="n_trial"):
        load_spec({"n_trial": 3})


@pytest.mark.parametrize(
    "fixed, message",
    [
        (["model=tiny"], r"sweep.fixed must map override keys to values .* not list \['model=tiny'\]"),
        ({"model": {"text_tokens": 1089}}, r"sweep.fixed.model is a mapping; .* dotted keys"),
    ],
)
def test_fixed_must_map_keys_to_override_values(fixed, message):
    with pytest.raises(SweepSpecError, match=message):
        load_spec({"fixed": fixed})


def test_fixed_renders_as_the_override_strings_of_the_study_name():
    assert fixed_overrides(
        {
            "model": "small",
            "model.text_tokens": 1089,
            "fusions.bias_activation": True,
            "recompute.modules": ["core_attn", "moe"],
            "data.path": None,
        }
    ) == [
        "model=small",
        "model.text_tokens=1089",
        "fusions.bias_activation=true",
        "recompute.modules=[core_attn,moe]",
        "data.path=null",
    ]


def test_a_space_inherits_its_parents_fixed_entries_and_overrides_some():
    """Each space lists only what it adds or changes: h200_small_s1664 replaces h200_single's GBS 32, and
    h200_small_fused adds its fusions to everything h200_small_s1664 has."""
    single, s1664, fused = (
        load_spec(compose_config([f"sweep={name}"]).sweep).fixed
        for name in ("h200_single", "h200_small_s1664", "h200_small_fused")
    )
    assert single["batch.gbs"] == 32
    assert s1664 == {**single, "model.text_tokens": 1089, "batch.gbs": 192}
    assert fused == {**s1664, "fusions.bias_activation": True, "fusions.cross_entropy": False}


def test_run_overrides_drop_sweep_and_hydra_settings():
    assert run_overrides(
        [
            "sweep=cpu_demo",
            "sweep.n_trials=3",
            "hydra.verbose=true",
            "hydra/launcher=basic",
            "batch.mbs=2",
            "+experiment=x",
        ]
    ) == ["batch.mbs=2", "+experiment=x"]


def test_shipped_spaces_are_there():
    assert {"cpu_demo", "h200_single", "h200_proxy", "cluster_3d"} <= set(SPACES)


@pytest.mark.parametrize("name", SPACES)
def test_shipped_space_parses_and_samples_plannable_configs(name):
    """Every shipped space composes, and a sample of it validates or is rejected with named rules only."""
    spec = load_spec(compose_config([f"sweep={name}"]).sweep)  # as Hydra composes it (a space may extend another)
    fixed = fixed_overrides(spec.fixed)
    space = Space.parse(spec.params, fixed_keys=list(spec.fixed))
    for i, values in enumerate(spec.first_trials):  # a shipped first trial always plans
        sampled = space.point(values, f"sweep.first_trials[{i}]")
        overrides = [f"sweep={name}", *fixed, *Space.overrides(sampled)]
        plan_trial(compose_config(overrides), overrides)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    groups = "|".join(compose_config([f"sweep={name}"]))  # a rejected config names a knob: model.*, parallel.*, ...
    valid = 0
    for _ in range(12):
        overrides = [f"sweep={name}", *fixed, *Space.overrides(space.suggest(study.ask()))]
        try:
            plan_trial(compose_config(overrides), overrides)
            valid += 1
        except ConfigError as exc:
            unnamed = [p for p in exc.problems if not re.search(rf"\b({groups})(\.[\w.*]+)?( contains |=)", p)]
            assert exc.problems and not unnamed, unnamed
    assert valid >= 1, f"no sampled config of {name} plans"
    if name == "cpu_demo":
        assert valid == 12, "every cpu_demo config must run on the CPU"
    if name == "h200_proxy":  # it extends h200_single: its knobs, the proxy model and its own micro-batches
        assert "cuda_graph" in spec.params and spec.params["batch.mbs"] == [1, 2, 4]
        assert "model=qwen3_vl_30b_a3b_proxy" in fixed
    assert (CONF_DIR / "sweep").is_dir() and not (CONF_DIR / "sweep").is_symlink()


COMMITTED_STUDIES = {
    "h200_single": "h200_single-22158414",
    "h200_proxy": "h200_proxy-afbde3bd",
    "h200_small_s1664": "h200_small_s1664-189b7026",
    "h200_small_fused": "h200_small_fused-0d458fce",
    "h200_small_packed": "h200_small_packed-aadc1538",
}
"""Studies whose state and results are committed under benchmarks/results/, or whose next device commands its
README gives (h200_small_packed): the same command must resume them."""


@pytest.mark.parametrize("name", sorted(COMMITTED_STUDIES))
def test_a_committed_study_keeps_its_name(name):
    """The name hashes the space's params, fixed overrides and objective; a refactor that renames a committed
    study would make ``sweep=<name>`` start a new one instead of resuming the results it points to."""
    arguments = [f"sweep={name}"]
    spec = load_spec(compose_config(arguments).sweep)
    fixed = run_overrides(SweeperImpl.job_overrides(spec, arguments))
    assert study_name(name, spec, fixed) == COMMITTED_STUDIES[name]
