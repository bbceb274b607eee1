"""Measured memory of finished runs against the estimate (``plan/memory.py``), part by part.

For each run directory: the measured peak next to the estimated lower bound, and, for eager runs with a census
step, what autograd saved per part (``metrics.json: saved_activations``) next to the estimate's parts. It reads
the runs a sweep or ``compare_configs.py`` left (``outputs/runs/*``), prints the table and writes the measured
figures as JSON in ``compare_configs.py``'s ``runs`` form, so ``tests/test_memory.py`` holds the estimate to them:

    python benchmarks/memory_table.py --out benchmarks/results/h200_small_s1664/memory.json outputs/runs/*
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import yaml

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.metrics.schema import METRICS_FILE, read_metrics
from moe_vlm_sweep.plan.layout import sharded_seq_length
from moe_vlm_sweep.plan.memory import ACTIVATION_PARTS, GIB, activation_parts, estimate, microbatches_in_flight


def measured_parts(measured: dict[str, float]) -> dict[str, float]:
    """The census's parts summed the way ``ACTIVATION_PARTS`` groups them (its layers are listed one by one)."""
    layers = sum(v for k, v in measured.items() if k.startswith("decoder.layers."))
    return {part: layers if part == "decoder.layers" else measured.get(part, 0.0) for part in ACTIVATION_PARTS}


def row(run_dir: Path) -> dict | None:
    if not (run_dir / METRICS_FILE).exists():
        return None
    metrics = read_metrics(run_dir)
    overrides = yaml.safe_load((run_dir / "overrides.yaml").read_text())
    out = {
        "config": run_dir.name,
        "overrides": overrides,
        "status": metrics.status,
        "peak_memory_gib": metrics.peak_memory_gib,
        "graphed_layers": metrics.graphed_layers,
    }
    if metrics.saved_activations is not None:
        out["saved_activations_gib"] = measured_parts(metrics.saved_activations.measured_gib)
        out["microbatches_in_flight"] = metrics.saved_activations.microbatches_in_flight
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "run | peak GiB | estimate | ratio | " + " | ".join(f"{p} saved/est" for p in ACTIVATION_PARTS),
        " | ".join(["---"] * (4 + len(ACTIVATION_PARTS))),
    ]
    for r in rows:
        cfg = compose_run_config(r["overrides"])
        predicted = estimate(cfg).total_gib
        cells = [
            r["config"],
            f"{r['peak_memory_gib']:.1f}",
            f"{predicted:.1f}",
            f"{predicted / r['peak_memory_gib']:.2f}",
        ]
        saved = r.get("saved_activations_gib")
        parts = activation_parts(cfg, sharded_seq_length(cfg))
        for part in ACTIVATION_PARTS:
            est = parts[part] * microbatches_in_flight(cfg) / GIB
            cells.append(f"{saved[part]:.2f} / {est:.2f}" if saved else "no census")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (outputs/runs/*)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = [r for r in map(row, sorted(args.runs)) if r and r["status"] == "ok"]
    report = table(rows)
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": shlex.join(["python", *sys.argv]),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "note": "measured figures only; the estimate is recomputed from the overrides by the code of the day",
                "table": report,
                "runs": rows,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
