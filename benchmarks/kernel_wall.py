"""A card's best config against a hand-written plain training loop of the same recipe, in one invocation.

The plain loop is ``runner_overhead.py``'s bare loop: the product's builders for the megatron-core model, its
data-parallel wrapping and optimizer, then per step forward and backward per micro-batch straight on the model
and an optimizer step, with the layout and knobs a user starts from (3D, padded rows, megatron's default
fusions). The best config runs through the worker, as a sweep's trial does. Both train the same recipe
(``config/recipe.py``: the model, its sequence, GBS, precision, data): the benchmark refuses two configs whose
recipe fingerprints differ, so the ratio is one of speed and never of training something else.

They alternate (plain, best, plain, best, ...) so machine drift hits both. Reported: each run's median step,
effective tokens/s per GPU and MFU; the best config's MFU as the median of its re-runs and the re-runs' CV (their
median step times' standard deviation over their mean); and the best over the plain loop in effective tokens/s.
The targets (``MFU_TARGET``, ``CV_TARGET``) are printed beside what was measured.

    python benchmarks/kernel_wall.py --hardware h100 --rounds 3 --out kernel_wall_h100.json
    python benchmarks/kernel_wall.py --common "model=tiny hardware=cpu" --plain "batch.mbs=2" --best "batch.mbs=4" \\
        --out /tmp/kernel_wall_cpu.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

from compare_configs import git_commit, write_result
from runner_overhead import run_bare, run_worker

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.plan.plan import RunPlan, make_plan

MFU_TARGET = 0.30
CV_TARGET = 0.02
RECIPE = "model=small parallel=3d batch.gbs=192 model.text_tokens=1089 train.warmup_steps=3 train.steps=8"
"""``model=small`` at 1664 decoder tokens (a multiple of 128) and GBS 192, the recipe the cards' studies train."""
PLAIN = "batch.mbs=32 cuda_graph=none recompute=none train.timeout_s=200"
"""Where a user's own loop starts: 3D, MBS 32, padded rows, megatron's default fusions, no recompute."""
BEST = {
    "h100": "batch.mbs=96 data.packing=true fusions.bias_activation=true fusions.linear_cross_entropy=true "
    "recompute=selective recompute.modules=[moe_act,layernorm] train.expandable_segments=true cuda_graph=none "
    "dispatcher=alltoall vision=trainable train.timeout_s=200",
    "h200": "batch.mbs=96 data.packing=true fusions.bias_activation=true fusions.linear_cross_entropy=true "
    "recompute=none train.expandable_segments=true cuda_graph=none dispatcher=alltoall vision=trainable "
    "train.timeout_s=200",
}
"""Each card's best measured config (``benchmarks/results/README.md``): on the H100 the fused loss at MBS 96 with
the elementwise parts recomputed; on the H200, with 141 GB, the same without recompute."""


def plan_of(overrides: list[str], outputs: Path) -> RunPlan:
    return make_plan(compose_run_config([*overrides, f"outputs_dir={outputs}"]), overrides)


def spread(values: list[float]) -> float:
    """Standard deviation over mean (0 for one value)."""
    return statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per loop its runs' median step, tokens/s and MFU; the best's re-run CV; the best over the plain loop."""
    out: dict = {}
    for loop, rs in runs.items():
        ok = [r for r in rs if r["status"] == "ok"]
        out[loop] = {
            "runs": len(rs),
            "ok": len(ok),
            "median_step_s": statistics.median(r["median"] for r in ok) if ok else None,
            "mfu": statistics.median(r["mfu"] for r in ok) if ok else None,
            "effective_tokens_per_s_per_gpu": (
                statistics.median(r["effective_tokens_per_s_per_gpu"] for r in ok) if ok else None
            ),
            "rerun_cv": spread([r["median"] for r in ok]) if ok else None,
        }
    plain, best = out["plain"], out["best"]
    if plain["ok"] and best["ok"]:
        out["best_over_plain"] = best["effective_tokens_per_s_per_gpu"] / plain["effective_tokens_per_s_per_gpu"]
        out["mfu_target_met"] = best["mfu"] >= MFU_TARGET
        out["cv_target_met"] = best["rerun_cv"] <= CV_TARGET
    return out


def table(runs: dict[str, list[dict]], summary: dict) -> str:
    lines = ["loop | run | status | step_ms | eff_tok/s/gpu | mfu_%", "--- | --- | --- | --- | --- | ---"]
    for loop, rs in runs.items():
        for i, r in enumerate(rs, 1):
            if r["status"] != "ok":
                lines.append(f"{loop} | {i} | {r['status']} | - | - | -")
                continue
            lines.append(
                f"{loop} | {i} | ok | {r['median'] * 1e3:.1f} | {r['effective_tokens_per_s_per_gpu']:.0f} | "
                f"{r['mfu'] * 100:.2f}"
            )
    lines.append("")
    for loop in ("plain", "best"):
        s = summary[loop]
        if s["ok"]:
            lines.append(
                f"{loop}: {s['ok']}/{s['runs']} ok, median step {s['median_step_s'] * 1e3:.1f} ms, "
                f"MFU {s['mfu'] * 100:.2f}%, re-run CV {s['rerun_cv'] * 100:.2f}%"
            )
        else:
            lines.append(f"{loop}: 0/{s['runs']} ok")
    if "best_over_plain" in summary:
        lines.append(
            f"best / plain effective tokens/s: {summary['best_over_plain']:.2f}x; MFU >= {MFU_TARGET:.0%}: "
            f"{'yes' if summary['mfu_target_met'] else 'no'}; re-run CV <= {CV_TARGET:.0%}: "
            f"{'yes' if summary['cv_target_met'] else 'no'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", help="a GPU hardware group with a preset (h100, h200)")
    parser.add_argument("--common", help="overrides of both loops (default: the recipe preset and --hardware)")
    parser.add_argument("--plain", default=PLAIN, help="the plain loop's own overrides")
    parser.add_argument("--best", help="the best config's overrides (default: --hardware's preset)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each loop (default 3)")
    parser.add_argument("--outputs", default="outputs/benchmarks", help="where the run directories go")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    if args.best is None and args.hardware not in BEST:
        parser.error(f"--best, or --hardware one of {sorted(BEST)}")
    common = args.common if args.common is not None else f"{RECIPE} hardware={args.hardware}"
    best = args.best if args.best is not None else BEST[args.hardware]
    overrides = {
        "plain": [*shlex.split(common), *shlex.split(args.plain)],
        "best": [*shlex.split(common), *shlex.split(best)],
    }
    outputs = Path(args.outputs)
    plans = {loop: plan_of(o, outputs) for loop, o in overrides.items()}
    fingerprints = {loop: (p.recipe or {}).get("fingerprint") for loop, p in plans.items()}
    if fingerprints["plain"] != fingerprints["best"]:
        print(f"the two loops train different recipes ({fingerprints}): compare configs of one recipe", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {"plain": [], "best": []}
    data = {
        "command": shlex.join(["python", *sys.argv]),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "overrides": overrides,
        "recipe": fingerprints["best"],
        "targets": {"mfu": MFU_TARGET, "rerun_cv": CV_TARGET},
        "runs": runs,
    }
    out = Path(args.out)
    for round_ in range(args.rounds):
        runs["plain"].append(run_bare(plans["plain"], outputs, f"plain{round_}"))
        runs["best"].append(run_worker(plans["best"], outputs, f"best{round_}"))
        print(f"round {round_ + 1}: plain {runs['plain'][-1]['status']}, best {runs['best'][-1]['status']}", flush=True)
        summary = summarize(runs)
        write_result(out, {**data, "summary": summary, "table": table(runs, summary)}, complete=False)
    summary = summarize(runs)
    print(table(runs, summary))
    write_result(out, {**data, "summary": summary, "table": table(runs, summary)}, complete=True)
    return 0 if summary["plain"]["ok"] and summary["best"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
