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
The targets (the preset's ``mfu_target``, ``CV_TARGET``) are printed beside what was measured.

    python benchmarks/kernel_wall.py --hardware h100 --rounds 3 --out kernel_wall_h100.json
    python benchmarks/kernel_wall.py --model qwen3_vl_30b_a3b_proxy --hardware h200 --out kernel_wall_h200_proxy.json
    python benchmarks/kernel_wall.py --common "model=tiny hardware=cpu" --plain "batch.mbs=2" --best "batch.mbs=4" \\
        --out /tmp/kernel_wall_cpu.json
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from compare_configs import git_commit, write_result
from runner_overhead import run_bare, run_worker

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.plan.plan import RunPlan, make_plan

CV_TARGET = 0.02


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    """One model's comparison: both loops train ``recipe``, so their ratio is one of speed alone."""

    recipe: str
    """The overrides that fix what is trained (model, sequence, GBS) and the steps measured."""
    plain: str
    """The plain loop's own overrides: where a user's hand-written loop starts."""
    best: dict[str, str]
    """Per card (hardware group), the config to hold against the plain loop: the best measured, or a candidate."""
    mfu_target: float
    """The MFU the best config's re-run median should reach: 30% for ``model=small`` on either card, 20% for the
    Qwen3-VL-30B-A3B proxy on an H200 (``benchmarks/results/README.md``, "Confirmed bests per card")."""

    def common(self, hardware: str) -> str:
        """The overrides both loops share on ``hardware``."""
        return f"{self.recipe} hardware={hardware}"


PRESETS = {
    "small": Preset(
        # 1664 decoder tokens (a multiple of 128) and GBS 192, the recipe the cards' studies train.
        recipe="model=small parallel=3d batch.gbs=192 model.text_tokens=1089 train.warmup_steps=3 train.steps=8",
        # Where a user's own loop starts: 3D, MBS 32, padded rows, megatron's default fusions, no recompute.
        plain="batch.mbs=32 cuda_graph=none recompute=none train.timeout_s=200",
        # On the H100 the fused loss at MBS 96 with the elementwise parts recomputed; on the H200, with 141 GB,
        # the same without recompute.
        best={
            "h100": "batch.mbs=96 data.packing=true fusions.bias_activation=true fusions.linear_cross_entropy=true "
            "recompute=selective recompute.modules=[moe_act,layernorm] train.expandable_segments=true "
            "cuda_graph=none dispatcher=alltoall vision=trainable train.timeout_s=200",
            "h200": "batch.mbs=96 data.packing=true fusions.bias_activation=true fusions.linear_cross_entropy=true "
            "recompute=none train.expandable_segments=true cuda_graph=none dispatcher=alltoall vision=trainable "
            "train.timeout_s=200",
        },
        mfu_target=0.30,
    ),
    "qwen3_vl_30b_a3b_proxy": Preset(
        # The h200_proxy study's recipe: GBS 8 of 2623 decoder tokens (one 768-px image and 2048 text tokens).
        recipe="model=qwen3_vl_30b_a3b_proxy parallel=3d batch.gbs=8 train.warmup_steps=3 train.steps=8",
        # The study's confirmed layout (3D, MBS 4, padded rows, megatron's default fusions) as a bare loop.
        plain="batch.mbs=4 cuda_graph=none recompute=none train.timeout_s=200",
        # The candidate: one micro-batch a step, the fused loss never holding the 151936-wide fp32 logits that kept
        # the study at MBS 4, packed rows, the fused SwiGLU.
        best={
            "h200": "batch.mbs=8 data.packing=true fusions.bias_activation=true fusions.linear_cross_entropy=true "
            "recompute=none train.expandable_segments=true cuda_graph=none dispatcher=alltoall vision=trainable "
            "train.timeout_s=200",
        },
        mfu_target=0.20,
    ),
}


def loop_overrides(common: str, plain: str, best: str) -> dict[str, list[str]]:
    """Each loop's override list: the overrides both share, then its own."""
    return {"plain": [*shlex.split(common), *shlex.split(plain)], "best": [*shlex.split(common), *shlex.split(best)]}


def plan_of(overrides: list[str], outputs: Path) -> RunPlan:
    return make_plan(compose_run_config([*overrides, f"outputs_dir={outputs}"]), overrides)


def spread(values: list[float]) -> float:
    """Standard deviation over mean (0 for one value)."""
    return statistics.stdev(values) / statistics.fmean(values) if len(values) > 1 else 0.0


def summarize(runs: dict[str, list[dict]], mfu_target: float) -> dict:
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
        out["mfu_target"] = mfu_target
        out["mfu_target_met"] = best["mfu"] >= mfu_target
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
            f"best / plain effective tokens/s: {summary['best_over_plain']:.2f}x; MFU >= {summary['mfu_target']:.0%}: "
            f"{'yes' if summary['mfu_target_met'] else 'no'}; re-run CV <= {CV_TARGET:.0%}: "
            f"{'yes' if summary['cv_target_met'] else 'no'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hardware", help="a GPU hardware group with a best config in --model's preset")
    parser.add_argument("--model", default="small", choices=sorted(PRESETS), help="the preset's model (default small)")
    parser.add_argument("--common", help="overrides of both loops (default: the preset's recipe and --hardware)")
    parser.add_argument("--plain", help="the plain loop's own overrides (default: the preset's)")
    parser.add_argument("--best", help="the best config's overrides (default: the preset's for --hardware)")
    parser.add_argument("--mfu-target", type=float, help="the best config's MFU target (default: the preset's)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each loop (default 3)")
    parser.add_argument("--outputs", default="outputs/benchmarks", help="where the run directories go")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    preset = PRESETS[args.model]
    if args.best is None and args.hardware not in preset.best:
        parser.error(f"--best, or --hardware one of {sorted(preset.best)} for --model {args.model}")
    common = args.common if args.common is not None else preset.common(args.hardware)
    best = args.best if args.best is not None else preset.best[args.hardware]
    plain = args.plain if args.plain is not None else preset.plain
    mfu_target = args.mfu_target if args.mfu_target is not None else preset.mfu_target
    overrides = loop_overrides(common, plain, best)
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
        "targets": {"mfu": mfu_target, "rerun_cv": CV_TARGET},
        "runs": runs,
    }
    out = Path(args.out)
    for round_ in range(args.rounds):
        runs["plain"].append(run_bare(plans["plain"], outputs, f"plain{round_}"))
        runs["best"].append(run_worker(plans["best"], outputs, f"best{round_}"))
        print(f"round {round_ + 1}: plain {runs['plain'][-1]['status']}, best {runs['best'][-1]['status']}", flush=True)
        summary = summarize(runs, mfu_target)
        write_result(out, {**data, "summary": summary, "table": table(runs, summary)}, complete=False)
    summary = summarize(runs, mfu_target)
    print(table(runs, summary))
    write_result(out, {**data, "summary": summary, "table": table(runs, summary)}, complete=True)
    return 0 if summary["plain"]["ok"] and summary["best"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
