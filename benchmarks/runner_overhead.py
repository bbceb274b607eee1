"""The runner's own cost: the project's worker against a bare loop of the same model and config, side by side.

The bare loop (written here) builds the same megatron-core model, data-parallel wrapping and optimizer with the
product's builders, so the model is the product's and not a look-alike. Per step it only zeroes the gradients,
runs forward and backward per micro-batch straight on the model, finalizes the gradients and steps the
optimizer: no pipeline schedule, no per-step loss reduction, no hooks. Both loops time a step the same way (a
device sync on each side) over already prefetched micro-batches. They run in their own processes, alternately
(worker, bare, worker, bare, ...), so machine drift hits both; the reported ratio is the worker's median step
time over the bare loop's (issue target: within 3%, a ratio <= 1.03).

    python benchmarks/runner_overhead.py --out overhead.json --repeats 2 \\
        --common "model=small hardware=h200 parallel=3d" --config mbs8="batch.mbs=8 batch.gbs=8"
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare_configs import git_commit

from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.model.flops import BatchTokens
from moe_vlm_sweep.plan.plan import RunPlan, make_plan

BARE_RESULT = "bare.json"
TARGET_RATIO = 1.03


def bare_loop(run_dir: Path) -> None:
    """Train ``run_dir/plan.json`` with the bare loop; write the measured step times to ``bare.json``."""
    import torch.distributed as dist

    from moe_vlm_sweep.train.loop import training_stream
    from moe_vlm_sweep.train.preflight import preflight
    from moe_vlm_sweep.train.worker import init_distributed

    plan = RunPlan.read(run_dir / "plan.json")
    if plan.layout.pp > 1:
        raise SystemExit("the bare loop runs one pipeline stage: use parallel.pp=1")
    preflight(plan)
    if plan.device == "cpu":
        from moe_vlm_sweep.train import cpu_compat

        cpu_compat.apply()
    init_distributed(plan)
    with training_stream(plan):
        times, batches = _bare_steps(plan)
    rates = bare_rates(plan, times, batches)
    if dist.get_rank() == 0:
        (run_dir / BARE_RESULT).write_text(json.dumps({"step_times": times, **rates}) + "\n")
    dist.destroy_process_group()


def bare_rates(plan: RunPlan, times: list[float], batches: list[BatchTokens]) -> dict:
    """The bare loop's throughput as the worker reports its own (``train/worker.py: step_rates``): the measured
    steps' mean batch over their median time, against the card's datasheet peak (one process, one replica)."""
    from moe_vlm_sweep.train.worker import measure_peak_tflops, step_rates

    peak, _ = measure_peak_tflops(plan)
    return step_rates(plan, BatchTokens.mean(batches), statistics.median(times), peak)


def _bare_steps(plan: RunPlan) -> tuple[list[float], list[BatchTokens]]:
    """Build, wrap and train with the bare loop; the measured steps' times and batches."""
    import torch

    from moe_vlm_sweep.model.build import build_model_chunks
    from moe_vlm_sweep.train.cuda_graphs import LLaVADecoderGraphs
    from moe_vlm_sweep.train.loop import rank_source, step_tokens, wrap_for_training

    cfg = plan.run_config
    models, optimizer = wrap_for_training(plan, build_model_chunks(plan))
    model, config = models[0], models[0].config
    image_dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    source = rank_source(plan)
    cuda = plan.device == "cuda"
    times: list[float] = []
    batches: list[BatchTokens] = []
    model.train()
    for step in range(cfg.train.warmup_steps + cfg.train.steps):
        if cfg.train.manual_gc and step == cfg.train.warmup_steps:  # the collector as the worker handles it
            gc.collect()
            gc.disable()
        if cfg.cuda_graph.impl == "transformer_engine" and step == cfg.cuda_graph.warmup_steps:
            LLaVADecoderGraphs(
                models, config, seq_length=plan.seq_length, micro_batch_size=cfg.batch.mbs, optimizers=[optimizer]
            ).capture()
        microbatches = [mb.to(plan.device, image_dtype) for mb in source.step(step, plan.num_microbatches)]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens = torch.zeros((), dtype=torch.int, device=plan.device)
        for mb in microbatches:
            output, loss_mask = model(
                images=mb.images,
                input_ids=mb.input_ids,
                position_ids=mb.position_ids,
                attention_mask=None,
                labels=mb.labels,
                loss_mask=mb.loss_mask,
            )
            mask = loss_mask.reshape(-1).float()
            torch.sum(output.float().reshape(-1) * mask).backward()
            tokens += mask.sum().to(torch.int)
        config.finalize_model_grads_func(models, tokens)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= cfg.train.warmup_steps:
            times.append(time.perf_counter() - start)
            batches.append(step_tokens(microbatches, plan.seq_length))
    return times, batches


def run_bare(plan: RunPlan, outputs: Path, name: str) -> dict:
    run_dir = new_run_dir(outputs, prefix=f"{name}-bare")
    prepare(run_dir, plan, "")
    with open(run_dir / "bare.log", "wb") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--bare", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=plan.run_config.train.timeout_s,
        )
    if proc.returncode != 0:
        return {
            "status": "crash",
            "run_dir": str(run_dir),
            "log_tail": (run_dir / "bare.log").read_text(errors="replace")[-3000:],
        }
    result = json.loads((run_dir / BARE_RESULT).read_text())
    times = result.pop("step_times")
    return {"status": "ok", "run_dir": str(run_dir), "median": statistics.median(times), "steps": times, **result}


def run_worker(plan: RunPlan, outputs: Path, name: str) -> dict:
    run_dir = new_run_dir(outputs, prefix=f"{name}-worker")
    prepare(run_dir, plan, "")
    result = launch(plan, run_dir)
    if not result.ok:
        return {
            "status": result.status,
            "reason": result.reason,
            "run_dir": str(run_dir),
            "log_tail": (run_dir / "worker.log").read_text(errors="replace")[-3000:],
        }
    assert result.metrics is not None  # an ok run has its metrics
    st = result.metrics.step_time_s
    return {
        "status": "ok",
        "run_dir": str(run_dir),
        "median": st.median,
        "steps": st.steps,
        "mfu": result.metrics.mfu,
        "effective_tokens_per_s_per_gpu": result.metrics.effective_tokens_per_s_per_gpu,
        "peak_memory_gib": result.metrics.peak_memory_gib,
        "recipe": result.metrics.recipe,
    }


def compare(name: str, overrides: list[str], outputs: Path, repeats: int) -> dict:
    plan = make_plan(compose_run_config([*overrides, f"outputs_dir={outputs}"]), overrides)
    runs: dict[str, list[dict]] = {"worker": [], "bare": []}
    for _ in range(repeats):
        runs["worker"].append(run_worker(plan, outputs, name))
        runs["bare"].append(run_bare(plan, outputs, name))
    row = {"config": name, "overrides": overrides, "runs": runs}
    if all(r["status"] == "ok" for rs in runs.values() for r in rs):
        worker = statistics.median(r["median"] for r in runs["worker"])
        bare = statistics.median(r["median"] for r in runs["bare"])
        row.update(
            status="ok",
            worker_median_s=worker,
            bare_median_s=bare,
            ratio=worker / bare,
            within_target=worker / bare <= TARGET_RATIO,
        )
    else:
        row["status"] = "failed"
    return row


def table(rows: list[dict]) -> str:
    lines = ["config | worker_ms | bare_ms | worker/bare | within 3%", "--- | --- | --- | --- | ---"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['config']} | failed | - | - | -")
            continue
        lines.append(
            f"{r['config']} | {r['worker_median_s'] * 1e3:.1f} | {r['bare_median_s'] * 1e3:.1f} | "
            f"{r['ratio']:.3f} | {'yes' if r['within_target'] else 'no'}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bare", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--common", default="", help="overrides shared by every config")
    parser.add_argument("--config", action="append", metavar="NAME=OVERRIDES", help="a named config")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each loop (default 2)")
    parser.add_argument("--outputs", default="outputs/benchmarks", help="where the run directories go")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args()
    if args.bare:
        bare_loop(Path(args.bare))
        return 0
    if not args.config or not args.out:
        parser.error("--config and --out are required")
    rows = []
    for spec in args.config:
        name, _, overrides = spec.partition("=")
        rows.append(
            compare(name, [*shlex.split(args.common), *shlex.split(overrides)], Path(args.outputs), args.repeats)
        )
        print(f"{name}: {rows[-1]['status']}", flush=True)
    print(table(rows))
    Path(args.out).write_text(
        json.dumps(
            {
                "command": shlex.join(["python", *sys.argv]),
                "git_commit": git_commit(),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "target_ratio": TARGET_RATIO,
                "table": table(rows),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
