"""The worker's result files: ``metrics.json`` (a finished run) and ``failure.json`` (a failed one).

Both are versioned dataclasses with a docstring per field, written atomically (tmp file in the same folder, then
``os.replace``) so a reader never mistakes a half-written file for a result. This module imports neither torch
nor megatron, so the sweep side can read results cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
METRICS_FILE = "metrics.json"
FAILURE_FILE = "failure.json"
FAILURE_CLASSES = ("oom", "invalid", "crash", "timeout", "nan")
COMPONENTS = ("vision_encoder", "projector", "decoder")


@dataclass(kw_only=True)
class StepTimes:
    """Steady-state optimizer-step times in seconds over the measured steps (warmup excluded), each step on its
    slowest rank."""

    median: float
    p10: float
    p90: float
    mean: float
    cv: float
    """Coefficient of variation (std / mean): how noisy the measurement is."""
    steps: list[float]
    """Every measured step's time, in order."""


@dataclass(kw_only=True)
class ComponentFlops:
    """FLOPs of one optimizer step over the whole world (all ranks, all micro-batches)."""

    model: float
    """Useful FLOPs: forward 1x, backward 2x (1x or 0 for frozen modules), no recompute (the MFU numerator)."""
    hardware: float
    """FLOPs executed: ``model`` plus recomputed forwards (the HFU numerator)."""


@dataclass(kw_only=True)
class ComponentSplit:
    """Mean time per step of each phase, measured in the separate profiling steps (synchronizing hooks)."""

    seconds: dict[str, float]
    """Phase -> seconds: ``<component>.forward``, ``<component>.backward``, ``grad_sync``, ``optimizer``,
    ``other`` (data, schedule, pipeline communication, glue between modules)."""
    shares: dict[str, float]
    """Phase -> fraction of the profiled step time (sums to 1)."""
    profile_steps: int
    measured_on: str
    """Which rank's modules the split covers (rank 0: the first pipeline stage under PP)."""


@dataclass(kw_only=True)
class Loss:
    """Loss of every step (warmup included), averaged over the step's real (loss-mask) tokens."""

    values: list[float]
    phases: list[str]
    """Per step: ``warmup``, ``measured`` or ``profile``."""


@dataclass(kw_only=True)
class SavedActivations:
    """What autograd saved for backward in the census step (``train/census.py``) on rank 0, the first pipeline
    stage, next to what ``plan/memory.py`` predicts for the same micro-batches in flight and precision."""

    measured_gib: dict[str, float]
    """Part (``train/census.py: CENSUS_PARTS``) -> GiB, and ``total``."""
    predicted_gib: dict[str, float]
    """Part (``plan/memory.py: ACTIVATION_PARTS``) -> GiB, and ``total``."""
    microbatches_in_flight: float
    """Micro-batches' worth of activations the estimate counts on the first stage (``pp``; more with VPP)."""


@dataclass(kw_only=True)
class OtherProcess:
    """A process that was not the trial's and used its GPU or its cores while it measured."""

    pid: int
    name: str
    where: str
    """``gpu <uuid>`` (a compute process on one of the trial's GPUs) or ``cpu`` (busy on the trial's cores)."""
    gpu_memory_mib: float | None = None
    """GPU memory it held at the sample that saw it (the largest), when the driver reports it."""
    cpu_percent: float | None = None
    """Its CPU use over the measured steps, in percent of one core."""


@dataclass(kw_only=True)
class Contention:
    """Who else used the trial's devices during its measured steps (``train/contention.py``), sampled at their
    start and end on every rank: a measurement shared with another job is slower than the config is."""

    processes: list[OtherProcess] = field(default_factory=list)
    gpu_source: str
    """How the GPUs were read: ``nvml``, ``nvidia-smi``, ``not a GPU run``, or ``unavailable: <why>``."""
    cores: list[int] = field(default_factory=list)
    """The CPU cores rank 0 may run on (a CPU run's processes count when busy on any of them)."""
    cpu_threshold_percent: float
    """Busy means at least this much of one core over the measured steps."""
    window_s: float
    """Seconds between the first and last sample."""
    rank_pids: list[int] = field(default_factory=list)
    """The trial's own ranks (never listed as other processes, nor are their children and launchers)."""


@dataclass(kw_only=True)
class Metrics:
    """``metrics.json``: one successful run."""

    schema_version: int = SCHEMA_VERSION
    status: str = "ok"
    data_realism: str
    """``data.realism`` of the run; results of different realism are never ranked together."""
    hardware: str
    """``hardware.name``."""
    recipe: str | None = None
    """The recipe fingerprint (plan.json's ``recipe``): runs of different recipes train different models."""
    device: str
    layout: dict[str, Any]
    """The resolved layout (RunPlan.layout) plus strategy, micro-batches and batch sizes."""
    step_time_s: StepTimes
    tokens_per_s: float
    """Padded decoder tokens per second over the world (what the model computes on)."""
    tokens_per_s_per_gpu: float
    effective_tokens_per_s: float
    """Real (non-padding) decoder tokens per second over the world."""
    effective_tokens_per_s_per_gpu: float
    padded_tokens_per_step: float
    """Decoder positions the model computes on per step, mean over the measured steps: every sample padded to the
    sequence as run, or, packed (``data.packing``), the real tokens only."""
    real_tokens_per_step: float
    """Real decoder tokens per step (text that is not padding plus image tokens), mean over the measured steps:
    ``effective_tokens_per_s = tokens_per_s * real_tokens_per_step / padded_tokens_per_step``."""
    flops_per_step: dict[str, ComponentFlops]
    """Component (``vision_encoder``, ``projector``, ``decoder``, ``total``) -> FLOPs per step."""
    model_tflops_per_s_per_gpu: float
    """Useful TFLOP/s per GPU (or per CPU worker process)."""
    hardware_tflops_per_s_per_gpu: float
    mfu: float
    """Useful FLOP/s per GPU over ``peak_tflops``."""
    hfu: float
    """Executed FLOP/s per GPU (recompute included) over ``peak_tflops``."""
    peak_tflops: float
    peak_source: str
    """``datasheet`` (hardware.peak_bf16_tflops) or ``measured_matmul`` (a matmul timed at start, on the CPU)."""
    peak_memory_gib: float
    """Max over ranks: torch.cuda.max_memory_allocated on GPU, peak RSS of the process on the CPU."""
    peak_memory_source: str
    predicted_peak_memory_gib: float | None = None
    """The planner's lower bound for GPU runs (``plan/memory.py``), to read next to the measured peak."""
    loss: Loss
    cuda_alloc_conf: str | None = None
    """PyTorch's CUDA allocator settings as the worker saw them (``PYTORCH_CUDA_ALLOC_CONF``, which the launcher
    sets from ``train.expandable_segments``); None for a worker started without the launcher."""
    wall_s: dict[str, float] = field(default_factory=dict)
    """Wall-clock seconds of the worker's parts on rank 0: ``startup.imports`` (interpreter and imports),
    ``startup.init`` (process groups), ``startup.build``, ``startup.wrap`` (DDP or FSDP, optimizer), then
    ``warmup``, ``capture``, ``measured``, ``profile``.
    The measured steps are often a small part of a sweep trial's cost; this says where the rest goes."""
    warmup_step_time_s: list[float] = field(default_factory=list)
    """Each warm-up step, timed like a measured step: the one-off costs of the first steps (kernel autotuning,
    JIT fusions, allocator growth) apart from the steady ones: in a sweep trial the warm-up can cost more than
    all the measured steps together."""
    gc_in_measured_steps: dict[str, float] = field(default_factory=dict)
    """Python garbage collections inside the measured steps (``count``, ``seconds``): 0 with ``train.manual_gc``
    (the default); with it off, the pauses that can make single host-bound steps slow."""
    graphed_layers: int = 0
    """Decoder layers per rank that replayed CUDA graphs in the measured steps (0 with ``cuda_graph=none``);
    a graph scope that graphed nothing fails the run instead of being measured as eager."""
    component_split: ComponentSplit | None = None
    """None when train.profile_steps is 0."""
    saved_activations: SavedActivations | None = None
    """None without a census step (``train.activation_census=false``, or CUDA graphs)."""
    accounting_notes: list[str] = field(default_factory=list)
    """The simplifications the FLOPs and token accounting still makes, said plainly."""
    contended: bool = False
    """Another process used the run's GPUs, or was busy on its cores, while it measured (``contention`` names
    it): the numbers are not the config's alone, and ``best`` ranks such trials after uncontended ones."""
    contention: Contention | None = None
    """The evidence behind ``contended``; None from a worker that did not probe."""


@dataclass(kw_only=True)
class Failure:
    """``failure.json``: why a run stopped."""

    schema_version: int = SCHEMA_VERSION
    status: str = "failed"
    failure_class: str
    """One of FAILURE_CLASSES; ``invalid`` is a preflight refusal, not a crash."""
    exception_type: str
    message: str
    rank: int
    step: int | None
    """The step being run (None before training started)."""
    traceback: str
    memory: dict[str, Any] | None = None
    """The failing rank's memory at the failure, in GiB (``train/oom.py: memory_state``): RSS, peak RSS, address
    space and its limit, available RAM, and on a GPU torch's allocated/reserved (and their peaks) with the device's
    free and total; an ``oom`` is judged from it as well as from the error."""

    def __post_init__(self) -> None:
        if self.failure_class not in FAILURE_CLASSES:
            raise ValueError(f"failure_class={self.failure_class!r} must be one of {', '.join(FAILURE_CLASSES)}")


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` so that ``path`` either does not exist or holds the whole file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_metrics(run_dir: Path, metrics: Metrics) -> Path:
    path = Path(run_dir) / METRICS_FILE
    write_json_atomic(path, dataclasses.asdict(metrics))
    return path


def write_failure(run_dir: Path, failure: Failure) -> Path:
    path = Path(run_dir) / FAILURE_FILE
    write_json_atomic(path, dataclasses.asdict(failure))
    return path


def _check_version(data: dict[str, Any], path: Path) -> None:
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")


def read_metrics(run_dir: Path) -> Metrics:
    path = Path(run_dir) / METRICS_FILE
    data = json.loads(path.read_text())
    _check_version(data, path)
    data["step_time_s"] = StepTimes(**data["step_time_s"])
    data["loss"] = Loss(**data["loss"])
    data["flops_per_step"] = {k: ComponentFlops(**v) for k, v in data["flops_per_step"].items()}
    if data.get("component_split") is not None:
        data["component_split"] = ComponentSplit(**data["component_split"])
    if data.get("saved_activations") is not None:
        data["saved_activations"] = SavedActivations(**data["saved_activations"])
    if data.get("contention") is not None:
        seen = data["contention"]
        data["contention"] = Contention(**{**seen, "processes": [OtherProcess(**p) for p in seen["processes"]]})
    return Metrics(**data)


def read_failure(run_dir: Path) -> Failure:
    path = Path(run_dir) / FAILURE_FILE
    data = json.loads(path.read_text())
    _check_version(data, path)
    return Failure(**data)
