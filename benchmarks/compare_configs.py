"""Run several configs side by side in one invocation and report each against the first (the baseline).

Machines here are noisy (a CPU-bound GPU step follows the host's CPU), so configs are only ever compared within
one run of this script, as ratios. Each config is a real run through the product's own path (validate, isolated
worker, metrics.json); the table is printed and everything is written as JSON with the exact command.

    python benchmarks/compare_configs.py --out results.json --common "model=small hardware=h200" \
        --config baseline="batch.mbs=8 batch.gbs=8" --config mbs16="batch.mbs=16 batch.gbs=16"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from moe_vlm_sweep import provenance
from moe_vlm_sweep.config.codec import to_dict
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.config.recipe import between, describe
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.plan.plan import make_plan
from moe_vlm_sweep.plan.rules import ConfigError

COLUMNS = (
    "config",
    "status",
    "step_ms",
    "cv_%",
    "eff_tok/s/gpu",
    "tok_ratio",
    "mfu_%",
    "hfu_%",
    "mem_gib",
    "graphed",
    "last_loss",
    "recipe",
)


def git_commit() -> str:
    """The code's commit: ``GIT_COMMIT`` where the tree was copied without ``.git`` (a GPU host), else the
    checkout's (``moe_vlm_sweep.provenance``)."""
    return os.environ.get("GIT_COMMIT") or provenance.git_commit() or "unknown"


def write_result(path: Path, data: dict, *, complete: bool) -> None:
    """``data`` as the JSON at ``path``, with ``complete``. The scripts rewrite it after every run, so a call cut off
    by a time limit keeps what it measured (``"complete": false``); written beside and renamed, so a kill while
    writing leaves the previous file whole. A file without ``complete`` (older than the key) is complete."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps({**data, "complete": complete}, indent=2) + "\n")
    os.replace(part, path)


def run_one(name: str, overrides: list[str], outputs: Path) -> dict:
    try:
        plan = make_plan(compose_run_config([*overrides, f"outputs_dir={outputs}"]), overrides)
    except ConfigError as exc:
        return {"config": name, "overrides": overrides, "status": "invalid", "reason": str(exc)}
    run_dir = new_run_dir(outputs, prefix=name)
    prepare(run_dir, plan, "")
    result = launch(plan, run_dir)
    row = {
        "config": name,
        "overrides": overrides,
        "status": result.status,
        "reason": result.reason,
        "run_dir": str(run_dir),
        "wall_s": result.wall_s,
        "recipe": plan.recipe,
    }
    if result.ok:
        m = result.metrics
        assert m is not None  # an ok run has its metrics
        row.update(
            step_time_s=to_dict(m.step_time_s),
            effective_tokens_per_s_per_gpu=m.effective_tokens_per_s_per_gpu,
            tokens_per_s_per_gpu=m.tokens_per_s_per_gpu,
            mfu=m.mfu,
            hfu=m.hfu,
            peak_memory_gib=m.peak_memory_gib,
            component_split=to_dict(m.component_split) if m.component_split else None,
            data_realism=m.data_realism,
            peak_tflops=m.peak_tflops,
            peak_source=m.peak_source,
            graphed_layers=m.graphed_layers,
            loss=to_dict(m.loss),
        )
    else:
        log = Path(run_dir, "worker.log").read_text(errors="replace")
        row["log_tail"] = log[-3000:]
    return row


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["status"] == "ok"), None)
    lines = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(" | ".join([r["config"], r["status"]] + ["-"] * (len(COLUMNS) - 2)))
            continue
        assert base is not None  # this row is ok, so there is a first ok row
        st = r["step_time_s"]
        ratio = r["effective_tokens_per_s_per_gpu"] / base["effective_tokens_per_s_per_gpu"]
        lines.append(
            " | ".join(
                [
                    r["config"],
                    "ok",
                    f"{st['median'] * 1e3:.1f}",
                    f"{st['cv'] * 100:.1f}",
                    f"{r['effective_tokens_per_s_per_gpu']:.0f}",
                    f"{ratio:.2f}",
                    f"{r['mfu'] * 100:.2f}",
                    f"{r['hfu'] * 100:.2f}",
                    f"{r['peak_memory_gib']:.1f}",
                    str(r["graphed_layers"]),
                    f"{r['loss']['values'][-1]:.4f}",
                    r["recipe"]["fingerprint"],
                ]
            )
        )
    return "\n".join(lines) + recipes_note(rows)


def recipes_note(rows: list[dict]) -> str:
    """Said under the table when its configs train different models (``config/recipe.py``): a ratio across
    recipes compares speed and what is trained at once."""
    ran = [r for r in rows if r.get("recipe")]
    if len({r["recipe"]["fingerprint"] for r in ran}) < 2:
        return ""
    base = ran[0]["recipe"]
    lines = [
        f"\nThese configs train {len({r['recipe']['fingerprint'] for r in ran})} different recipes; "
        f"tok_ratio compares across them. Against {ran[0]['config']} ({base['fingerprint']}):"
    ]
    for r in ran[1:]:
        if r["recipe"]["fingerprint"] != base["fingerprint"]:
            diff = between(r["recipe"]["differs"], base["differs"])
            lines.append(f"- {r['config']} ({r['recipe']['fingerprint']}): " + describe(diff))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--common", default="", help="overrides shared by every config")
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        metavar="NAME=OVERRIDES",
        help="a named config; the first is the baseline of the ratios",
    )
    parser.add_argument("--outputs", default="outputs/benchmarks", help="where the run directories go")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    common = shlex.split(args.common)
    rows = []
    for spec in args.config:  # the JSON is rewritten after every config: a cut-off call keeps what it measured
        name, _, overrides = spec.partition("=")
        rows.append(run_one(name, [*common, *shlex.split(overrides)], Path(args.outputs)))
        print(f"{name}: {rows[-1]['status']} {rows[-1].get('reason', '')}", flush=True)
        write_result(
            Path(args.out),
            {
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "table": table(rows),
                "runs": rows,
            },
            complete=len(rows) == len(args.config),
        )
    print(table(rows))
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
