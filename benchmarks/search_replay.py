"""How fast each sampler finds a good config, measured on a recorded grid instead of re-running trials.

Step 1 (``measure``) runs every config of a space once, through the sweep's own launch path (a warm trial
host), and records each config's objective and wall seconds to JSON. Step 2 (``replay``) runs samplers over the
recorded table for many seeds, each trial answered from the table: how many measured trials, and how many
measured seconds (the recorded walls), until the best found is within ``--within`` (2%) of the grid's best.

Samplers replayed: ``tpe`` (Optuna's TPE as the sweeper configures it, ``sweep/study.py``), ``random``, ``gp``
(Optuna's GPSampler), ``grid`` (every config once, in a random order per seed) and ``sweeper`` (TPE with the
sweeper's own duplicate handling: a repeated config is claimed as a duplicate through ``sweep/ledger.py``, told
as failed and never measured, the next trial walks one knob out from the best or draws at random, as
``hydra_plugins/moe_vlm_sweep_sweeper/_impl.py`` does). The plain samplers re-measure a repeated config (that is
what a plain Optuna loop does), so a repeat costs its wall again. Invalid configs cost nothing (the sweeper
never launches them) and are told as pruned.

    python benchmarks/search_replay.py measure --space cpu_demo --out benchmarks/results/search_grid_cpu.json
    python benchmarks/search_replay.py replay --grid benchmarks/results/search_grid_cpu.json --seeds 50 \\
        --out benchmarks/results/search_replay_cpu.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from compare_configs import git_commit
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from moe_vlm_sweep.config.compose import CONF_DIR
from moe_vlm_sweep.launch import warm_host
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.plan.compose import INVALID_ERRORS, compose_plan
from moe_vlm_sweep.sweep import ledger
from moe_vlm_sweep.sweep.space import Space, fixed_overrides
from moe_vlm_sweep.sweep.spec import SweepConf, load_spec
from moe_vlm_sweep.sweep.study import exploring, neighbor_of_best, sampler
from moe_vlm_sweep.sweep.trial import metric_value

SAMPLERS = ("tpe", "random", "gp", "grid", "sweeper")


def load_space(name: str) -> tuple[SweepConf, Space]:
    node = OmegaConf.load(CONF_DIR / "sweep" / f"{name}.yaml")
    assert isinstance(node, DictConfig)  # a sweep space is a mapping
    node.pop("defaults", None)
    spec = load_spec(node)
    return spec, Space.parse(spec.params)


def grid_points(space: Space) -> list[dict[str, Any]]:
    """Every config of a categorical space, conditions applied (a param whose condition fails is absent)."""
    points: list[dict[str, Any]] = [{}]
    for param in space.params:
        if param.kind != "categorical":
            raise SystemExit(f"sweep.params.{param.key} is not categorical: only a categorical space has a grid")
        grown = []
        for point in points:
            if all(c.holds(point) for c in param.when):
                grown += [{**point, param.key: choice} for choice in param.choices]
            else:
                grown.append(point)
        points = grown
    return points


def key_of(point: dict[str, Any]) -> str:
    return json.dumps(point, sort_keys=True)


# --- step 1: the grid ------------------------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> int:
    spec, space = load_space(args.space)
    base = [*fixed_overrides(spec.fixed), *shlex.split(args.extra or "")]
    outputs = Path(args.workdir or f"/tmp/search_grid-{int(time.time())}")
    rows = []
    for point in grid_points(space):
        overrides = [*base, *Space.overrides(point), f"outputs_dir={outputs}"]
        row: dict[str, Any] = {"params": point, "overrides": Space.overrides(point)}
        try:
            plan, resolved_yaml = compose_plan(overrides)
        except INVALID_ERRORS as exc:
            rows.append(row | {"status": "invalid", "reason": str(exc), "wall_s": 0.0, "value": None})
            continue
        run_dir = new_run_dir(outputs, prefix="grid")
        prepare(run_dir, plan, resolved_yaml)
        result = launch(plan, run_dir, warm=True)
        value = metric_value(result.metrics, spec.objective.metric) if result.ok and result.metrics else None
        rows.append(
            row | {"status": result.status, "reason": result.reason[-200:], "wall_s": result.wall_s, "value": value}
        )
        print(f"{' '.join(row['overrides'])}: {result.status} {value} in {result.wall_s:.1f} s", flush=True)
    warm_host.close_hosts()
    Path(args.out).write_text(
        json.dumps(
            {
                "question": f"Every config of sweep={args.space}, measured once: the table samplers are replayed on.",
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "space": args.space,
                "metric": spec.objective.metric,
                "direction": spec.objective.direction,
                "base_overrides": base,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 0


# --- step 2: the replay -----------------------------------------------------------------------------------------


class Table:
    def __init__(self, grid: dict):
        self.maximize = grid["direction"] == "maximize"
        self.rows = {key_of(r["params"]): r for r in grid["rows"]}
        values = [r["value"] for r in grid["rows"] if r["value"] is not None]
        self.best = max(values) if self.maximize else min(values)

    def good(self, value: float | None, within: float) -> bool:
        if value is None:
            return False
        return value >= self.best * (1 - within) if self.maximize else value <= self.best * (1 + within)


def _tell(study: optuna.Study, trial: optuna.Trial, row: dict) -> None:
    if row["value"] is not None:
        study.tell(trial, row["value"])
    else:
        study.tell(trial, state=TrialState.PRUNED)  # invalid or OOM: as the sweeper tells them


def replay_one(
    name: str, seed: int, table: Table, space: Space, spec: SweepConf, within: float, max_trials: int
) -> dict:
    """Trials until within ``within`` of the grid's best: (measured trials, measured seconds), or None."""
    make: dict[str, Callable[[], optuna.samplers.BaseSampler]] = {
        "tpe": lambda: sampler(spec, seed),
        "sweeper": lambda: sampler(spec, seed),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
        "gp": lambda: optuna.samplers.GPSampler(seed=seed, n_startup_trials=10),
    }
    measured, seconds, proposals = 0, 0.0, 0
    if name == "grid":
        order = list(table.rows.values())
        random.Random(seed).shuffle(order)
        for row in order:
            measured += row["status"] != "invalid"
            seconds += row["wall_s"]
            if table.good(row["value"], within):
                return {"trials": measured, "seconds": seconds, "proposals": measured}
        return {"trials": None, "seconds": None, "proposals": measured}
    study = optuna.create_study(direction="maximize" if table.maximize else "minimize", sampler=make[name]())
    explorer, walker, dup_in_a_row = optuna.samplers.RandomSampler(seed=seed + 1), random.Random(seed + 1), 0
    while measured < max_trials and proposals < 10 * max_trials:
        proposals += 1
        with exploring(study, explorer, now=name == "sweeper" and dup_in_a_row > 0):
            trial = study.ask()
            point = space.suggest(trial)
        row = table.rows[key_of(point)]
        if name == "sweeper" and ledger.claim(study, trial, trial.params) is not None:
            study.tell(trial, state=TrialState.FAIL)  # a duplicate: never measured, TPE learns nothing from it
            dup_in_a_row += 1
            proposal = neighbor_of_best(study, space, walker)
            if proposal:
                study.enqueue_trial(proposal[1])
            continue
        dup_in_a_row = 0
        measured += row["status"] != "invalid"
        seconds += row["wall_s"]
        _tell(study, trial, row)
        if table.good(row["value"], within):
            return {"trials": measured, "seconds": seconds, "proposals": proposals}
    return {"trials": None, "seconds": None, "proposals": proposals}


def replay(args: argparse.Namespace) -> int:
    grid = json.loads(Path(args.grid).read_text())
    spec, space = load_space(grid["space"])
    table = Table(grid)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    results: dict[str, list[dict]] = {}
    for name, seed in itertools.product(args.samplers.split(","), range(args.seeds)):
        results.setdefault(name, []).append(replay_one(name, seed, table, space, spec, args.within, args.max_trials))
    summary = {}
    for name, runs in results.items():
        reached = [r for r in runs if r["trials"] is not None]
        summary[name] = {
            "reached": f"{len(reached)}/{len(runs)}",
            "median_trials": statistics.median(r["trials"] for r in reached) if reached else None,
            "mean_trials": statistics.fmean(r["trials"] for r in reached) if reached else None,
            "p90_trials": sorted(r["trials"] for r in reached)[int(0.9 * (len(reached) - 1))] if reached else None,
            "median_seconds": statistics.median(r["seconds"] for r in reached) if reached else None,
            "mean_seconds": statistics.fmean(r["seconds"] for r in reached) if reached else None,
        }
    good = sum(table.good(r["value"], args.within) for r in grid["rows"])
    lines = [
        f"grid: {len(grid['rows'])} configs ({sum(r['value'] is not None for r in grid['rows'])} measured), "
        f"best {grid['metric']}={table.best:.4g}, {good} within {args.within:.0%} of it",
        "sampler | reached | median trials | mean trials | p90 trials | median s | mean s",
        "--- | --- | --- | --- | --- | --- | ---",
    ]
    fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for name, s in summary.items():
        lines.append(
            f"{name} | {s['reached']} | {fmt(s['median_trials'])} | {fmt(s['mean_trials'])} | "
            f"{fmt(s['p90_trials'])} | {fmt(s['median_seconds'])} | {fmt(s['mean_seconds'])}"
        )
    text = "\n".join(lines)
    Path(args.out).write_text(
        json.dumps(
            {
                "question": f"Trials and measured seconds until within {args.within:.0%} of the grid's best, per sampler",
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "grid": args.grid,
                "seeds": args.seeds,
                "max_trials": args.max_trials,
                "summary": summary,
                "table": text,
                "replays": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(text)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    m = sub.add_parser("measure", help="run every config of a space once and record it")
    m.add_argument("--space", default="cpu_demo")
    m.add_argument("--extra", help="overrides after the space's fixed ones (e.g. train.steps=2)")
    m.add_argument("--workdir")
    m.add_argument("--out", required=True)
    r = sub.add_parser("replay", help="replay samplers on a recorded grid")
    r.add_argument("--grid", required=True)
    r.add_argument("--samplers", default=",".join(SAMPLERS))
    r.add_argument("--seeds", type=int, default=50)
    r.add_argument("--within", type=float, default=0.02)
    r.add_argument("--max-trials", type=int, default=60)
    r.add_argument("--out", required=True)
    args = parser.parse_args()
    return measure(args) if args.step == "measure" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
