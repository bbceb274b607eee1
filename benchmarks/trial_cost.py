"""Where a trial's wall time goes: the same configs run the way a sweep ran them before (a fresh interpreter per
trial) and the way it runs them now (forked from a warm trial host), side by side in one invocation.

Per trial, by phase (from the worker's ``metrics.json`` and the launcher's wall): imports, init (process groups,
the CPU's peak), build, wrap (DDP/FSDP and the optimizer), the first warm-up step, the other warm-up (the rest
of the warm-up phase, graph capture included), the timed steps (the sum of the measured steps' times), census
and profile steps, and ``rest`` (the launcher's wall minus all of those: start or fork, teardown, the measured
phase's data fetch and reductions, writing the result). ``timed %`` is the timed steps' share of the trial's
wall, the part of a GPU-hour that measures. The first warm trial includes the host's start (its imports), once
per sweep.

Each mode has its own outputs directory, so its compile caches (``launch/compile_cache.py``) start empty in both;
they alternate per config (fresh, warm, fresh, warm, ...) so machine drift hits both.

    python benchmarks/trial_cost.py --out benchmarks/results/trial_cost_cpu.json            # CPU, model=tiny
    python benchmarks/trial_cost.py --hardware h100 --out trial_cost_h100.json              # GPU, model=small
    python benchmarks/trial_cost.py --hardware h200 --config mbs16="batch.mbs=16" --common "model=small ..."

The GPU preset (3D, MBS 32, 3 warm-up steps, as in the H100 run that found the compile cost) measures the two
fusions megatron-core compiles with torch.compile (``bias_dropout``: ``fusions/fused_bias_dropout.py``;
``cross_entropy``: ``fusions/fused_cross_entropy.py``, both through ``megatron.core.jit.jit_fuser``) on, against
the default and against ``fusions=off``: the first warm-up steps say what the compile costs per trial, the step
times what it buys (the other fusions are Transformer Engine kernels, compiled when TE was built).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from compare_configs import git_commit

from moe_vlm_sweep.launch import warm_host
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.metrics.schema import Metrics
from moe_vlm_sweep.plan.compose import compose_plan

MODES = ("fresh", "warm")
PHASES = ("imports", "init", "build", "wrap", "first_step", "other_warmup", "timed_steps", "census_profile", "rest")
PRESETS = {
    "cpu": (
        "model=tiny hardware=cpu train.warmup_steps=1 train.steps=3 train.profile_steps=0",
        {
            "mbs1": "batch.mbs=1",
            "mbs2_frozen": "batch.mbs=2 vision=frozen",
            "mbs4_selective": "batch.mbs=4 recompute=selective dispatcher=allgather",
        },
    ),
    "gpu": (
        "model=small parallel=3d batch.mbs=32 batch.gbs=32 train.warmup_steps=3 train.steps=8 "
        "train.profile_steps=1 train.timeout_s=600",
        {
            "compiled_fusions": "fusions.bias_dropout=true fusions.cross_entropy=true",
            "default": "",
            "fusions_off": "fusions=off",
        },
    ),
}


def phases(metrics: Metrics, wall: float) -> dict[str, float]:
    """The trial's wall split by phase (seconds); ``rest`` is what no phase of the worker accounts for."""
    w, steps = metrics.wall_s, metrics.step_time_s.steps
    first = (metrics.warmup_step_time_s or [0.0])[0]
    split = {
        "imports": w.get("startup.imports", 0.0),
        "init": w.get("startup.init", 0.0),
        "build": w.get("startup.build", 0.0),
        "wrap": w.get("startup.wrap", 0.0),
        "first_step": first,
        "other_warmup": w.get("warmup", 0.0) + w.get("capture", 0.0) - first,
        "timed_steps": sum(steps),
        "census_profile": w.get("census", 0.0) + w.get("profile", 0.0),
    }
    split["rest"] = wall - sum(split.values())
    return split


def run_one(mode: str, name: str, overrides: list[str], outputs: Path) -> dict:
    overrides = [*overrides, f"outputs_dir={outputs}"]
    plan, resolved_yaml = compose_plan(overrides)
    run_dir = new_run_dir(outputs, prefix=name)
    prepare(run_dir, plan, resolved_yaml)
    result = launch(plan, run_dir, warm=mode == "warm")
    row = {
        "config": name,
        "mode": mode,
        "status": result.status,
        "reason": result.reason[-300:],
        "wall_s": result.wall_s,
        "run_dir": str(run_dir),
    }
    if result.ok:
        split = phases(result.metrics, result.wall_s)
        row |= {
            "phases_s": split,
            "timed_share": split["timed_steps"] / result.wall_s,
            "step_median_s": result.metrics.step_time_s.median,
            "step_cv": result.metrics.step_time_s.cv,
        }
    return row


def summarize(rows: list[dict]) -> dict[str, dict]:
    out = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        ok = [r for r in mine if r["status"] == "ok"]
        later = ok[1:]  # every trial after the first: the host's start is in the first warm one
        total = sum(r["wall_s"] for r in mine)
        out[mode] = {
            "trials": len(mine),
            "ok": len(ok),
            "total_wall_s": total,
            "trials_per_hour": 3600 * len(mine) / total if total else None,
            "median_wall_s": statistics.median(r["wall_s"] for r in ok) if ok else None,
            "median_timed_share": statistics.median(r["timed_share"] for r in ok) if ok else None,
            "median_phases_s": {p: statistics.median(r["phases_s"][p] for r in ok) for p in PHASES} if ok else {},
            "max_imports_after_first_s": max((r["phases_s"]["imports"] for r in later), default=None),
        }
    if all(out[m]["total_wall_s"] for m in MODES):
        out["warm_over_fresh_trials_per_hour"] = out["warm"]["trials_per_hour"] / out["fresh"]["trials_per_hour"]
    return out


def table(rows: list[dict], summary: dict) -> str:
    head = ["config", "mode", "wall", *PHASES, "timed %", "step ms"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(" | ".join([r["config"], r["mode"], f"{r['wall_s']:.1f}", r["status"], r["reason"][:60]]))
            continue
        p = r["phases_s"]
        lines.append(
            " | ".join(
                [
                    r["config"],
                    r["mode"],
                    f"{r['wall_s']:.1f}",
                    *(f"{p[k]:.2f}" for k in PHASES),
                    f"{100 * r['timed_share']:.1f}",
                    f"{1e3 * r['step_median_s']:.1f}",
                ]
            )
        )
    lines.append("")
    for mode in MODES:
        s = summary[mode]

        def fmt(value, scale=1.0, digits=1):
            return "-" if value is None else f"{scale * value:.{digits}f}"

        lines.append(
            f"{mode}: {s['ok']}/{s['trials']} ok, {s['total_wall_s']:.1f} s in all, "
            f"{fmt(s['trials_per_hour'], digits=0)} trials/hour, median wall {fmt(s['median_wall_s'])} s, "
            f"median timed share {fmt(s['median_timed_share'], 100)}%, imports after the first trial <= "
            f"{fmt(s['max_imports_after_first_s'], digits=2)} s"
        )
    if summary.get("host_start_failed"):
        lines.append(f"the warm host did not start (its trials ran fresh): {summary['host_start_failed']}")
    if "warm_over_fresh_trials_per_hour" in summary:
        lines.append(f"warm / fresh trials per hour: {summary['warm_over_fresh_trials_per_hour']:.2f}x")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="cpu", help="cpu, or a GPU hardware group (h100, h200, ...)")
    parser.add_argument("--common", help="overrides of every config (default: the hardware's preset)")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="a config to measure (repeatable; default: the hardware's preset)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the configs")
    parser.add_argument("--workdir", help="where the two outputs directories go (default: a new temp dir)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    common, presets = PRESETS["cpu" if args.hardware == "cpu" else "gpu"]
    common = args.common if args.common is not None else f"{common} hardware={args.hardware}"
    configs = dict(c.split("=", 1) for c in args.config) or presets
    root = Path(args.workdir or tempfile.mkdtemp(prefix="trial_cost-"))
    rows = []
    for _ in range(args.repeats):
        for name, extra in configs.items():
            for mode in MODES:
                rows.append(row := run_one(mode, name, shlex.split(f"{common} {extra}"), root / mode))
                print(f"{name} {mode}: {row['status']} in {row['wall_s']:.1f} s", flush=True)
    host_imports = next((h.imports_s for h in warm_host._hosts.values()), None)
    warm_host.close_hosts()
    # A host that could not start (a CUDA context after its imports, say) leaves the warm trials fresh: say so.
    summary = summarize(rows) | {
        "host_imports_s": host_imports,
        "host_start_failed": list(warm_host._failed_starts.values()),
    }
    text = table(rows, summary)
    Path(args.out).write_text(
        json.dumps(
            {
                "question": "Where does a trial's wall go, fresh interpreter per trial against a warm trial host?",
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
                "common": common,
                "configs": configs,
                "summary": summary,
                "table": text,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(text)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
