"""The confirmed bests per card: one table per GPU kind from the committed results, never from a single run.

A row is a measurement whose figure is a median over re-runs: a study's confirmation (``best --confirm``,
``confirm.json``: its winner's re-run median) or a kernel-wall comparison (``kernel_wall.py``: the best config's
re-runs beside a plain training loop of the same recipe, in one invocation; one cut off before its last round
says so). Each row says its model, where it comes from, the config's performance overrides, the re-runs' MFU
median and step-time CV, the plain loop's MFU and the best over it where measured, and the recipe fingerprint,
so rows of different recipes are never read as one ranking. Cards are never mixed in a table.

    python benchmarks/card_summary.py --results benchmarks/results --out benchmarks/results/card_summary.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from compare_configs import git_commit, write_result

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.config.recipe import MEASUREMENT, Knob, fingerprint, kind

COLUMNS = ("model", "source", "config", "re-runs", "mfu_%", "rerun_cv_%", "plain_mfu_%", "best/plain", "recipe")


def _last(overrides: list[str], key: str) -> str | None:
    """The value the last ``key=value`` override sets (a later override wins, as in Hydra)."""
    values = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key]
    return values[-1] if values else None


def _config(overrides: list[str]) -> str:
    """What the row chose, the last override of each key: its config groups and the fields that are performance
    knobs (``config/recipe.py``); the model, card, launcher, how the run was measured and the recipe's own
    fields (GBS, sequence) are left to the other columns."""
    chosen: dict[str, str] = {}
    for o in overrides:
        key, _, value = o.partition("=")
        if key in {"model", "hardware", "launcher"} or key in MEASUREMENT:
            continue
        if "." in key and kind(key) is Knob.RECIPE:
            continue
        chosen[key] = value
    return " ".join(f"{k}={v}" for k, v in chosen.items())


def _recipe(overrides: list[str]) -> str:
    return fingerprint(compose_run_config([o for o in overrides if not o.startswith("outputs_dir=")]))


def from_confirmation(path: Path, results: Path) -> dict | None:
    data = json.loads(path.read_text())
    winner = next((c for c in data["candidates"] if c["trial"] == data["winner"] and c["ok"]), None)
    if winner is None or data["objective_metrics"][0] != "mfu":
        return None
    overrides = winner["overrides"]
    return {
        "card": _last(overrides, "hardware"),
        "model": _last(overrides, "model"),
        "source": f"{path.relative_to(results)} (study {data['study']}, trial #{winner['trial']})",
        "config": _config(overrides),
        "reruns": len(winner["repeats"]),
        "mfu": winner["median_values"][0],
        "rerun_cv": winner["step_time_cv_across_repeats"],
        "plain_mfu": None,
        "best_over_plain": None,
        "recipe": _recipe(overrides),
    }


def from_kernel_wall(path: Path, results: Path) -> dict | None:
    data = json.loads(path.read_text())
    best, plain = data["summary"]["best"], data["summary"]["plain"]
    if not best["ok"]:
        return None
    overrides = data["overrides"]["best"]
    cut_off = "" if data.get("complete", True) else f", cut off after {best['runs']} rounds"
    return {
        "card": _last(overrides, "hardware"),
        "model": _last(overrides, "model"),
        "source": f"{path.relative_to(results)} (kernel wall, commit {data['git_commit'][:7]}{cut_off})",
        "config": _config(overrides),
        "reruns": best["ok"],
        "mfu": best["mfu"],
        "rerun_cv": best["rerun_cv"],
        "plain_mfu": plain["mfu"],
        "best_over_plain": data["summary"].get("best_over_plain"),
        "recipe": data["recipe"],
    }


def rows(results: Path) -> list[dict]:
    found = [from_confirmation(p, results) for p in sorted(results.rglob("confirm.json"))]
    found += [from_kernel_wall(p, results) for p in sorted(results.rglob("kernel_wall_*.json"))]
    return sorted((r for r in found if r), key=lambda r: (r["card"], r["model"], -r["mfu"]))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.2f}"


def table(found: list[dict]) -> str:
    blocks = []
    for card in sorted({r["card"] for r in found}):
        lines = [f"{card}:", " | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
        for r in (r for r in found if r["card"] == card):
            ratio = "-" if r["best_over_plain"] is None else f"{r['best_over_plain']:.2f}x"
            lines.append(
                f"{r['model']} | {r['source']} | {r['config']} | {r['reruns']} | {_pct(r['mfu'])} | "
                f"{_pct(r['rerun_cv'])} | {_pct(r['plain_mfu'])} | {ratio} | {r['recipe']}"
            )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="benchmarks/results", help="the committed results folder")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    found = rows(Path(args.results))
    text = table(found)
    print(text)
    write_result(
        Path(args.out),
        {
            "command": shlex.join(["python", *sys.argv]),
            "git_commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "table": text,
            "rows": found,
        },
        complete=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
