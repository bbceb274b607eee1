"""One readable block per finished run: the result a person looks at first."""

from __future__ import annotations

from moe_vlm_sweep.launch.result import RunResult


def summarize(result: RunResult) -> str:
    if not result.ok:
        return (f"FAILED ({result.status}): {result.reason}\n"
                f"  see {result.run_dir}/worker.log")
    return f"ok in {result.wall_s:.1f} s: {result.run_dir}/metrics.json"
