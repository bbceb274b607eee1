"""How much image-free mock data flatters a VLM: mock_text vs synthetic_images, same model and layout, one run.

Both configs go through the product's own path (compare_configs.run_one: validate, isolated worker,
metrics.json), back to back, so the machine's noise hits both alike; the table is compare_configs' with
synthetic_images as the baseline, and the JSON records the ratios and the exact command. ``--shards`` adds
real webdataset shards as a third config.

    python benchmarks/realism.py --common "model=tiny" --out benchmarks/results/cpu_realism_tiny.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from compare_configs import git_commit, run_one, table

CONFIGS = {"synthetic_images": ["data=synthetic_images"], "mock_text": ["data=mock_text"]}


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """mock_text over synthetic_images: how much faster the misleading data makes the same model look."""
    mock, synthetic = rows["mock_text"], rows["synthetic_images"]
    return {
        "mock_over_synthetic_effective_tokens_per_s": mock["effective_tokens_per_s_per_gpu"]
        / synthetic["effective_tokens_per_s_per_gpu"],
        "mock_over_synthetic_padded_tokens_per_s": mock["tokens_per_s_per_gpu"] / synthetic["tokens_per_s_per_gpu"],
        "synthetic_over_mock_step_time": synthetic["step_time_s"]["median"] / mock["step_time_s"]["median"],
        "mock_over_synthetic_mfu": mock["mfu"] / synthetic["mfu"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--common", default="model=tiny", help="overrides shared by every config")
    parser.add_argument("--shards", help="webdataset shards (data.shards) to add a real_images config")
    parser.add_argument("--outputs", default="outputs/benchmarks", help="where the run directories go")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    configs = dict(CONFIGS)
    if args.shards:
        configs["webdataset"] = ["data=webdataset", f"data.shards='{args.shards}'"]
    common = shlex.split(args.common)
    rows = {}
    for name, overrides in configs.items():
        rows[name] = run_one(name, [*common, *overrides], Path(args.outputs))
        print(f"{name}: {rows[name]['status']} {rows[name].get('reason') or ''}", flush=True)
    ok = all(r["status"] == "ok" for r in rows.values())
    result = ratios(rows) if ok else {}
    print(table(list(rows.values())))
    for key, value in result.items():
        print(f"{key}: {value:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "ratios": result,
                "table": table(list(rows.values())),
                "runs": list(rows.values()),
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
