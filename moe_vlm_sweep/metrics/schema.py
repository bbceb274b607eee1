"""The worker's result files: ``metrics.json`` (a finished run) and ``failure.json`` (a failed one).

Both are versioned dataclasses with a docstring per field, written atomically (tmp file in the same folder, then
``os.replace``) so a reader never mistakes a half-written file for a result. This module imports neither torch
nor megatron, so the sweep side can read results cheaply.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config.codec import DecodeError, from_dict
from moe_vlm_sweep.launch.status import WORKER_FAILURES, RunStatus

SCHEMA_VERSION = 1
METRICS_FILE = "metrics.json"
FAILURE_FILE = "failure.json"
FAILURE_CLASSES = WORKER_FAILURES
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
    measured: int | None = None
    """How many steps were measured: ``train.steps``, or fewer where ``train.target_cv`` stopped measuring."""
    stopped_by: str | None = None
    """Why measuring stopped (``train/steps.py``): ``steps`` (``train.steps`` measured) or ``target_cv`` (the CV
    reached ``train.target_cv`` after ``train.min_steps``)."""
    target_cv: float | None = None
    """``train.target_cv`` of the run (None: a fixed count of steps)."""


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
    """Per step: ``warmup``, ``census`` (an untimed step counting saved tensors), ``measured`` or ``profile``."""
    grad_norms: list[float | None] = field(default_factory=list)
    """Per step, the gradients' global L2 norm before clipping (``clip_grad`` 1.0), as megatron's optimizer computes
    it: beside the loss, a second sign that two configs train the same model (a gradient counted twice doubles it,
    which Adam's update would hide from the loss)."""


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
    status: RunStatus = RunStatus.OK
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
    """Useful FLOP/s per GPU over ``peak_tflops``. On a GPU that is the card's dense bf16 peak whatever the run's
    precision, FP8 runs included (whose GEMMs could reach about twice it), so bf16 and FP8 runs compare on one
    scale: an FP8 run's MFU says how much faster it trains the same model, not how close FP8 runs to its own
    peak."""
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
    ``warmup``, ``capture``, ``census``, ``measured``, ``profile``.
    The measured steps are often a small part of a sweep trial's cost; this says where the rest goes."""
    warmup_step_time_s: list[float] = field(default_factory=list)
    """Each plain warm-up step (the census step, the last warm-up step by default, is not one), timed like a
    measured step: the one-off costs of the first steps (kernel autotuning, JIT fusions, allocator growth) apart
    from the steady ones: in a sweep trial the warm-up can cost more than all the measured steps together."""
    gc_in_measured_steps: dict[str, float] = field(default_factory=dict)
    """Python garbage collections inside the measured steps (``count``, ``seconds``): 0 with ``train.manual_gc``
    (the default); with it off, the pauses that can make single host-bound steps slow."""
    graphed_layers: int = 0
    """Decoder layers per rank that replayed CUDA graphs in the measured steps (0 with ``cuda_graph=none``);
    a graph scope that graphed nothing fails the run instead of being measured as eager."""
    fp8: dict[str, Any] | None = None
    """``train.precision=fp8`` runs: ``recipe`` (``train.fp8_recipe``), ``format`` (``hybrid``: E4M3 forward, E5M2
    gradients), ``te_recipes`` (the TE recipe classes the FP8 modules ran) and, on rank 0's model after training,
    the modules holding a matrix as [name, count] pairs (layer numbers as ``*``): ``fp8_modules``, those whose last
    forward TE ran in FP8 (its own record), and ``bf16_modules``, the rest (the ViT, the projector, the embedding,
    the router, the output layer). None without FP8."""
    component_split: ComponentSplit | None = None
    """None when train.profile_steps is 0."""
    saved_activations: SavedActivations | None = None
    """None without a census step (``train.activation_census=false``, or CUDA graphs), or when it failed."""
    data_wait_s: list[float] = field(default_factory=list)
    """Per measured step (slowest rank), the seconds the trainer waited for its micro-batches before the step's
    timer started: what the loader's worker had not built yet (drawing, decoding and resizing images, packing; on
    the training process itself without ``data.loader_workers``) and the copy to the device. Left out of
    ``step_time_s``; near or above a step's time, the data path, not the model, would bound a real run."""
    warmup_data_wait_s: list[float] = field(default_factory=list)
    """The same wait per warm-up step (slowest rank). The first step's includes the start of the loader's worker
    processes and their build of the first step (``data.loader_workers``): part of a trial's cost before its
    measurement, which ``warmup_step_time_s`` leaves out."""
    census_failure: str | None = None
    """Why the census step failed (``ExceptionType: message``), or None: a census that could not count (a library
    that rejects saved-tensor hooks) leaves the run its measurements, and says so here."""
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
    failure_class: RunStatus
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
        self.failure_class = RunStatus(self.failure_class)


def _write_tmp(path: Path, payload: dict[str, Any]) -> str:
    """``payload`` in a whole, synced temporary file beside ``path``; the caller publishes it under its name."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` so that ``path`` either does not exist or holds the whole file."""
    path = Path(path)
    tmp = _write_tmp(path, payload)
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_metrics(run_dir: Path, metrics: Metrics) -> Path:
    path = Path(run_dir) / METRICS_FILE
    write_json_atomic(path, dataclasses.asdict(metrics))
    return path


def failure_of_rank(run_dir: Path, rank: int) -> Path:
    """Where a rank's failure goes when another rank's is already ``failure.json``."""
    return Path(run_dir) / f"failure.rank{rank}.json"


_NATIVE_CRASH = "native_crash.rank{}.txt"
NATIVE_CRASH_MARK = "a native crash; every thread's stack is in"
"""What every native crash's reason says (:attr:`NativeCrash.reason`): the test suite reruns on it."""


def native_crash_file(run_dir: Path, rank: int) -> Path:
    """Where a rank's faulthandler writes every thread's Python stack if a native crash (SIGSEGV, SIGABRT on a
    corrupted heap or an uncaught C++ exception, SIGBUS) ends it: such a rank cannot write ``failure.json``.
    The worker removes the file again when it ends without one."""
    return Path(run_dir) / _NATIVE_CRASH.format(rank)


@dataclass(frozen=True)
class NativeCrash:
    """A rank that died in native code, from its :func:`native_crash_file`."""

    rank: int
    path: Path
    headline: str
    """faulthandler's first line: ``Fatal Python error: Aborted``, ``... Segmentation fault``."""
    at_ns: int
    """When it was written (the file's modification time, ns): a peer's failure after it is its consequence."""

    @property
    def reason(self) -> str:
        return f"rank {self.rank}: {self.headline} ({NATIVE_CRASH_MARK} {self.path.name})"


def drop_empty_native_crash_files(run_dir: Path) -> None:
    """Once a run's ranks are gone: the empty files of ranks that ended without a native crash but before they
    could remove theirs (a SIGKILL, a SIGTERM, a timeout), so a run directory shows only real crashes."""
    for path in Path(run_dir).glob(_NATIVE_CRASH.format("*")):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size == 0:
                path.unlink()


def first_native_crash(run_dir: Path) -> NativeCrash | None:
    """The earliest native crash among the run's ranks, or None."""
    crashes = []
    prefix, suffix = _NATIVE_CRASH.split("{}")
    for path in Path(run_dir).glob(_NATIVE_CRASH.format("*")):
        rank = path.name.removeprefix(prefix).removesuffix(suffix)
        text = path.read_text(errors="replace").strip() if rank.isdigit() else ""  # not a copy a person left
        if text:
            crashes.append(NativeCrash(int(rank), path, text.splitlines()[0], path.stat().st_mtime_ns))
    return min(crashes, key=lambda crash: (crash.at_ns, crash.rank), default=None)


def write_failure(run_dir: Path, failure: Failure) -> Path:
    """Record ``failure``; return the file it went to.

    The run's cause is the first failure, whichever rank met it: ``failure.json`` is published with ``os.link``,
    which fails when the name exists, so of two ranks failing at once exactly one wins (a check for the file and
    then a replace lets the later rank, often only a peer's broken pipe, overwrite the cause). Every later
    failure is kept beside it as ``failure.rank<N>.json``."""
    first = Path(run_dir) / FAILURE_FILE
    tmp = _write_tmp(first, dataclasses.asdict(failure))
    try:
        try:
            os.link(tmp, first)
            return first
        except FileExistsError:
            other = failure_of_rank(run_dir, failure.rank)
            os.replace(tmp, other)
            return other
    finally:
        Path(tmp).unlink(missing_ok=True)


def _read(cls: type[Any], path: Path) -> Any:
    """``path`` read into ``cls``; a file of another schema version, a missing field or an unknown one is a
    :class:`DecodeError` naming the file and the field, not a ``KeyError`` in whichever consumer reads it."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DecodeError(f"{path}: not JSON ({exc})") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise DecodeError(f"{path}: schema_version {version!r} is not {SCHEMA_VERSION} (written by another version)")
    try:
        return from_dict(cls, data, where=str(path))
    except DecodeError:
        raise
    except ValueError as exc:  # a field's own check (Failure.failure_class)
        raise DecodeError(f"{path}: {exc}") from None


def read_metrics(run_dir: Path) -> Metrics:
    """The run's ``metrics.json``; raises FileNotFoundError without one, DecodeError for one that does not fit."""
    return _read(Metrics, Path(run_dir) / METRICS_FILE)


def read_failure(run_dir: Path) -> Failure:
    """The run's ``failure.json``; raises FileNotFoundError without one, DecodeError for one that does not fit."""
    return _read(Failure, Path(run_dir) / FAILURE_FILE)
