"""The training worker: ``python -m moe_vlm_sweep.train.worker RUN_DIR`` (alone, or under torchrun).

Reads ``RUN_DIR/plan.json``, checks the machine can run it (failing fast, class ``invalid``, never falling back),
initialises torch.distributed and megatron's parallel state, builds, trains, and leaves exactly one result:
``metrics.json`` (rank 0) or ``failure.json``. Imports neither optuna, mlflow nor hydra: the plan file is all it
needs, so any run can be replayed from its run directory.

``python -m moe_vlm_sweep.train.worker --serve [MODULE...]`` is a sweep's warm trial host instead: it imports
:data:`PRELOAD` (and the modules named) once and forks a fresh worker per trial (``launch/warm_host.py``). Rank 0
appends each measured step to ``progress.jsonl`` as it ends, for a sweep's early stop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from moe_vlm_sweep.console import configure_logging, say
from moe_vlm_sweep.launch.lifeline import watch_launcher
from moe_vlm_sweep.launch.local import ALLOC_CONF_ENVS, SERVE_FLAG
from moe_vlm_sweep.launch.run_dir import PROGRESS_FILE
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.launch.warm_host import serve
from moe_vlm_sweep.metrics.schema import (
    COMPONENTS,
    ComponentSplit,
    Failure,
    Loss,
    Metrics,
    SavedActivations,
    StepTimes,
    native_crash_file,
    write_failure,
    write_metrics,
)
from moe_vlm_sweep.plan.layout import sharded_seq_length
from moe_vlm_sweep.plan.memory import ELEMENT_BYTES, GIB, activation_parts, microbatches_in_flight
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.train.contention import describe, gathered_contention, gathered_probe
from moe_vlm_sweep.train.oom import is_out_of_memory, memory_state
from moe_vlm_sweep.train.preflight import PreflightError, preflight
from moe_vlm_sweep.train.steps import cv

logger = logging.getLogger(__name__)


def init_distributed(plan: RunPlan) -> None:
    """torch.distributed from torchrun's env (or a world of one), then megatron's groups, seeds, micro-batches."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    store = None
    if "RANK" not in os.environ:  # a world of one rendezvous in its own memory: no port to find, none to lose
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        store = dist.HashStore()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if plan.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = timedelta(seconds=plan.run_config.train.timeout_s)
    backend = "nccl" if plan.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    p, cfg = plan.layout, plan.run_config
    parallel_state.initialize_model_parallel(
        **p.megatron_sizes(),
    )
    # CPU initialisation draws from torch's default generator: the same seed everywhere keeps replicas equal.
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(
        cfg.train.seed, te_rng_tracker=plan.graph_rng == "te", use_cudagraphable_rng=plan.graph_rng == "cudagraphable"
    )
    init_num_microbatches_calculator(rank, None, cfg.batch.gbs, cfg.batch.mbs, p.dp)


def measure_peak_tflops(plan: RunPlan) -> tuple[float, str]:
    """The datasheet peak on GPU; on the CPU the best of ten 50 ms bursts of square matmuls in the run's
    precision (the best, because a peak is what the core can do when nothing else competes for it)."""
    hw = plan.run_config.hardware
    if plan.device == "cuda":
        assert hw.peak_bf16_tflops is not None  # required of GPU hardware (HardwareConf)
        return float(hw.peak_bf16_tflops), "datasheet"
    dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
    n = 512
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(10):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.05:
            a @ b
            reps += 1
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - start) / 1e12)
    tflops = torch.tensor([best], dtype=torch.float64)
    dist.all_reduce(tflops)
    return float(tflops) / dist.get_world_size(), "measured_matmul"


def _peak_memory_gib(plan: RunPlan) -> tuple[float, str]:
    if plan.device == "cuda":
        value, source = torch.cuda.max_memory_allocated(), "torch.cuda.max_memory_allocated"
    else:
        value, source = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_rss"
    peak = torch.tensor([float(value)], dtype=torch.float64, device="cuda" if plan.device == "cuda" else "cpu")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak) / 2**30, f"{source} (max over ranks)"


def _slowest_rank(step_times: list[float], plan: RunPlan) -> list[float]:
    """Each step's time on the slowest rank: a step of the job ends when its last rank ends (ranks that finish a
    step early wait in the next step's first collective, which their own clocks would count elsewhere)."""
    times = torch.tensor(step_times, dtype=torch.float64, device="cuda" if plan.device == "cuda" else "cpu")
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def _deciles(values: list[float]) -> list[float]:
    """The 9 cut points p10..p90, interpolated between the measured steps (``inclusive``: the fastest step is p0
    and the slowest p100, NumPy's default); one step is every decile (Python 3.12's quantiles wants two)."""
    return statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9


def step_rates(plan: RunPlan, batch, seconds: float, peak_tflops: float, flops: dict | None = None) -> dict:
    """The throughput fields of ``metrics.json`` for a step of ``batch`` taking ``seconds``: of the run (its mean
    batch, its median step) and of each measured step as it ends (``progress.jsonl``)."""
    from moe_vlm_sweep.model.flops import step_flops

    world = plan.layout.world_size
    flops = flops or step_flops(plan.run_config, batch, transformer_impl=plan.transformer_impl)
    model_tflops = flops["total"].model / seconds / world / 1e12
    hardware_tflops = flops["total"].hardware / seconds / world / 1e12
    return {
        "tokens_per_s": batch.padded_tokens / seconds,
        "tokens_per_s_per_gpu": batch.padded_tokens / seconds / world,
        "effective_tokens_per_s": batch.real_tokens / seconds,
        "effective_tokens_per_s_per_gpu": batch.real_tokens / seconds / world,
        "model_tflops_per_s_per_gpu": model_tflops,
        "hardware_tflops_per_s_per_gpu": hardware_tflops,
        "mfu": model_tflops / peak_tflops,
        "hfu": hardware_tflops / peak_tflops,
    }


class _Progress:
    """Rank 0 appends each measured step to ``progress.jsonl`` (its time and rates), so a sweep can stop a trial
    that is already clearly slower than its best; the worker itself never talks to the study."""

    def __init__(self, plan: RunPlan, run_dir: Path, peak_tflops: float):
        self.plan, self.path, self.peak, self.measured = plan, run_dir / PROGRESS_FILE, peak_tflops, 0

    def __call__(self, seconds: float, batch) -> None:
        if dist.get_rank() != 0:
            return
        self.measured += 1
        line = {
            "measured_step": self.measured,
            "step_time_s": seconds,
            **step_rates(self.plan, batch, seconds, self.peak),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def build_metrics(
    plan: RunPlan,
    result,
    peak: tuple[float, str],
    memory: tuple[float, str],
    startup_s: dict[str, float] | None = None,
    precision_scope: dict[str, Any] | None = None,
) -> Metrics:
    from moe_vlm_sweep.data import text_ids_note
    from moe_vlm_sweep.model.flops import ACCOUNTING_NOTES, BatchTokens, step_flops

    cfg = plan.run_config
    times = result.step_times
    median, mean = statistics.median(times), statistics.fmean(times)
    # The measured steps' batches (they vary per step): their mean step, against the median step time.
    measured = BatchTokens.mean([b for b, phase in zip(result.batches, result.phases) if phase == "measured"])
    flops = step_flops(cfg, measured, transformer_impl=plan.transformer_impl)
    r = step_rates(plan, measured, median, peak[0], flops)
    split = None
    if result.split_seconds:
        # A component that did not run (no images, or no backward when frozen) reads 0, not missing.
        seconds = {f"{c}.{d}": 0.0 for c in COMPONENTS for d in ("forward", "backward")} | result.split_seconds
        total = sum(seconds.values())
        split = ComponentSplit(
            seconds=seconds,
            shares={k: v / total for k, v in seconds.items()},
            profile_steps=cfg.train.profile_steps,
            measured_on="rank 0 (first pipeline stage)",
        )
    layout = {
        **dataclasses.asdict(plan.layout),
        "strategy": cfg.parallel.strategy,
        "fsdp_sharding": cfg.parallel.fsdp_sharding if cfg.parallel.strategy == "fsdp" else None,
        "num_microbatches": plan.num_microbatches,
        "mbs": cfg.batch.mbs,
        "gbs": cfg.batch.gbs,
        "seq_length": plan.seq_length,
        "precision": plan.precision,
        "transformer_impl": plan.transformer_impl,
        "token_dispatcher": cfg.dispatcher.token_dispatcher,
        "recompute": cfg.recompute.granularity,
    }
    padded, real = measured.padded_tokens, measured.real_tokens
    deciles = _deciles(times)
    return Metrics(
        data_realism=cfg.data.realism,
        hardware=cfg.hardware.name,
        device=plan.device,
        layout=layout,
        recipe=(plan.recipe or {}).get("fingerprint"),
        step_time_s=StepTimes(
            median=median,
            p10=deciles[0],
            p90=deciles[-1],
            mean=mean,
            cv=cv(times),
            steps=times,
            measured=len(times),
            stopped_by=result.measuring.stop.value if result.measuring and result.measuring.stop else None,
            target_cv=cfg.train.target_cv,
        ),
        **r,
        padded_tokens_per_step=padded,
        real_tokens_per_step=real,
        flops_per_step=flops,
        peak_tflops=peak[0],
        peak_source=peak[1],
        peak_memory_gib=memory[0],
        peak_memory_source=memory[1],
        predicted_peak_memory_gib=plan.predicted_peak_memory_gib,
        loss=Loss(values=result.losses, phases=result.phases, grad_norms=result.grad_norms),
        cuda_alloc_conf=os.environ.get(ALLOC_CONF_ENVS[0]),
        wall_s={**(startup_s or {}), **result.wall_s},
        warmup_step_time_s=result.warmup_step_times,
        gc_in_measured_steps=result.gc_in_measured_steps,
        graphed_layers=result.graphed_layers,
        fp8={"recipe": plan.fp8_recipe, "format": "hybrid", **precision_scope} if precision_scope else None,
        component_split=split,
        saved_activations=_saved_activations(plan, result.saved_activation_bytes),
        census_failure=result.census_failure,
        data_wait_s=result.data_wait_s,
        warmup_data_wait_s=result.warmup_data_wait_s,
        accounting_notes=[*ACCOUNTING_NOTES, *filter(None, [text_ids_note(cfg.data)])],
    )


def _saved_activations(plan: RunPlan, measured: dict[str, int] | None) -> SavedActivations | None:
    """The census next to the estimate's parts, in the run's precision, for the micro-batches in flight."""
    if measured is None:
        return None
    cfg = plan.run_config
    in_flight = microbatches_in_flight(cfg)
    parts = activation_parts(cfg, sharded_seq_length(cfg), ELEMENT_BYTES[plan.precision])
    predicted = {part: in_flight * value / GIB for part, value in parts.items()}
    return SavedActivations(
        measured_gib={**{k: v / GIB for k, v in measured.items()}, "total": sum(measured.values()) / GIB},
        predicted_gib={**predicted, "total": sum(predicted.values())},
        microbatches_in_flight=in_flight,
    )


def classify(exc: BaseException, memory: dict | None = None) -> RunStatus:
    """Failure class of an exception: a refused plan is ``invalid``, not a crash; an out-of-memory is judged from
    the error and ``memory``, the memory at the failure (``train/oom.py``)."""
    from moe_vlm_sweep.config.schema import ConfigFieldError
    from moe_vlm_sweep.plan.rules import ConfigError
    from moe_vlm_sweep.train.loop import NonFiniteLoss

    if isinstance(exc, (PreflightError, ConfigError, ConfigFieldError)):
        return RunStatus.INVALID
    if isinstance(exc, NonFiniteLoss):
        return RunStatus.NAN
    if is_out_of_memory(exc, memory):
        return RunStatus.OOM
    return RunStatus.CRASH


class _StartupClock:
    """Seconds of the worker's start before the first step, by phase: ``startup.imports`` (from the process's
    creation: interpreter, torch, megatron, TE), ``startup.init`` (process groups), ``startup.build`` and
    ``startup.wrap`` (DDP or FSDP and the optimizer). A trial's wall time beyond its steps is here."""

    def __init__(self) -> None:
        self.last = psutil.Process().create_time()
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[f"startup.{phase}"], self.last = now - self.last, now


def run(run_dir: Path) -> None:
    clock = _StartupClock()
    plan = RunPlan.read(run_dir / "plan.json")
    preflight(plan)
    if plan.device == "cpu":
        from moe_vlm_sweep.train import cpu_compat

        cpu_compat.apply()

    from moe_vlm_sweep.data import prefetched
    from moe_vlm_sweep.model.build import build_model_chunks, precision_scope
    from moe_vlm_sweep.train.loop import Trainer, rank_source, training_stream

    clock.mark("imports")
    init_distributed(plan)
    cfg = plan.run_config
    peak = measure_peak_tflops(plan)
    source = rank_source(plan)
    clock.mark("init")
    with (
        training_stream(plan),
        prefetched(
            source,
            cfg.data,
            cfg.model,
            device=plan.device,
            micro_batch_size=cfg.batch.mbs,
            num_microbatches=plan.num_microbatches,
        ) as source,
    ):
        chunks = build_model_chunks(plan)
        clock.mark("build")
        trainer = Trainer(plan, chunks, source)
        clock.mark("wrap")
        probe = gathered_probe(plan.device)
        on_step, on_measured = probe.around(
            warmup_steps=cfg.train.warmup_steps,
            steps=cfg.train.steps,
            on_step=_note_step,
            on_measured=_Progress(plan, run_dir, peak[0]),
        )
        result = trainer.run(
            on_step=on_step,
            trace_dir=run_dir if cfg.train.trace else None,
            on_measured=on_measured,
            first_step_trace_dir=run_dir if cfg.train.trace_first_step and dist.get_rank() == 0 else None,
        )
    probe.stop()  # measuring stopped early by train.target_cv: the window ends here
    contention = gathered_contention(probe)
    scope = precision_scope(chunks) if plan.fp8_recipe else None
    memory = _peak_memory_gib(plan)
    result.step_times = _slowest_rank(result.step_times, plan)
    result.warmup_step_times = _slowest_rank(result.warmup_step_times, plan)
    result.data_wait_s = _slowest_rank(result.data_wait_s, plan)
    result.warmup_data_wait_s = _slowest_rank(result.warmup_data_wait_s, plan)
    if dist.get_rank() == 0:
        if result.saved_tensor_sources:
            (run_dir / "saved_tensors.txt").write_text(result.saved_tensor_sources)
        metrics = build_metrics(plan, result, peak, memory, clock.seconds, scope)
        metrics.contended, metrics.contention = bool(contention.processes), contention
        path = write_metrics(run_dir, metrics)
        say(
            f"[worker] wrote {path}: median step {statistics.median(result.step_times) * 1e3:.1f} ms, "
            f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}"
        )
        if metrics.contended:
            logger.warning("contended measurement: %s", describe(contention.processes))


_current_step: int | None = None


def _note_step(step: int) -> None:
    global _current_step
    _current_step = step


def skip_jax() -> None:
    """TE's package init imports ``transformer_engine.jax`` whenever jax is installed, and only warns when that
    extension is missing: 1.0 s of every trial's imports on the H200 image (``-X importtime``; the wall-time gain
    is inside the import chain's noise, benchmarks/results/h200_imports/). This worker is PyTorch only."""
    sys.modules.setdefault("jax", None)  # type: ignore[arg-type]  # None blocks an import; typeshed omits it


PRELOAD = (
    "torch.distributed",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "moe_vlm_sweep.train.cpu_compat",
    "moe_vlm_sweep.train.loop",
    "moe_vlm_sweep.model.build",
    "moe_vlm_sweep.model.flops",
    "moe_vlm_sweep.data",
    "moe_vlm_sweep.plan.rules",
    "moe_vlm_sweep.train.machine_rules",
)
"""What a warm trial host imports once for all its trials: everything :func:`run` imports, lazily or not."""


def main(argv: list[str]) -> int:
    skip_jax()
    if len(argv) >= 2 and argv[1] == SERVE_FLAG:
        return serve([*PRELOAD, *argv[2:]], main)
    configure_logging(prefix="[worker] ")
    watch_launcher()
    if len(argv) != 2:
        say("usage: python -m moe_vlm_sweep.train.worker RUN_DIR", err=True)
        return 2
    run_dir = Path(argv[1])
    if not run_dir.is_dir():
        say(f"no run directory {run_dir}", err=True)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    with _native_crash_log(native_crash_file(run_dir, rank)):
        return _run_and_record(run_dir, rank)


@contextlib.contextmanager
def _native_crash_log(path: Path) -> Iterator[None]:
    """A native crash (SIGSEGV, SIGABRT on a corrupted heap or an uncaught C++ exception) ends the rank without
    a Python exception, so failure.json cannot say where: faulthandler writes every thread's Python stack to
    ``path``, one file per rank, so the launcher can name the rank that died first (its peers then fail on a
    closed connection, which is not the cause). A rank that returns removes its empty file; the launcher removes
    those of ranks killed by a signal faulthandler does not catch (SIGTERM, SIGKILL). The process group's
    teardown is inside (a crash there is the run's); a crash after it, in a library's destructor or atexit, leaves
    its stacks in the worker's log."""
    with path.open("w") as log:
        faulthandler.enable(log, all_threads=True)
        try:
            yield
        finally:
            faulthandler.enable(sys.stderr, all_threads=True)
    with contextlib.suppress(FileNotFoundError):  # the launcher may have dropped it (its host gone)
        if path.stat().st_size == 0:
            path.unlink()


def _run_and_record(run_dir: Path, rank: int) -> int:
    """Train ``run_dir``'s plan; a Python exception becomes this rank's failure record and exit status 1."""
    try:
        run(run_dir)
    except BaseException as exc:
        tb = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, tb.rstrip())
        memory = memory_state()  # the failed step's tensors are still alive: the traceback holds their frames
        write_failure(  # the first rank's cause is failure.json; a peer's broken pipe goes beside it
            run_dir,
            Failure(
                failure_class=classify(exc, memory),
                memory=memory,
                exception_type=type(exc).__name__,
                message=str(exc),
                rank=rank,
                step=_current_step,
                traceback=tb,
            ),
        )
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
