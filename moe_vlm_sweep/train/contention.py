"""Who else used a trial's GPUs and cores while it measured, so a shared measurement is flagged, not trusted.

Three workers on one 2-core machine measured the same config at 1239 tok/s against 3393 tok/s with two. The sweep
hands each trial its own devices (``sweep/devices.py``), but other jobs on the host do not take those locks. So
every rank samples at the start and at the end of the measured steps: the compute processes on its GPU (NVML
through ``pynvml`` when installed, else ``nvidia-smi --query-compute-apps``), and on a CPU run the processes busy
on its cores (psutil: CPU seconds between the two samples). The trial's own process tree (its ranks, their
children, their launchers) is not "other". Rank 0 gathers what every rank saw into ``metrics.json``'s
``contention`` and sets ``contended``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import psutil

from moe_vlm_sweep.metrics.schema import Contention, OtherProcess

CONTENDING_CPU_PERCENT = 10.0
"""A process busy for at least this share of one core over the measured steps contends with a CPU run: the
shell, an editor or an idle server stays far below it; any compute loop is far above."""

_MIB = 2**20
_log = logging.getLogger(__name__)


def own_pids(rank_pids: Iterable[tuple[str, int]]) -> set[int]:
    """The trial's processes on this host: each rank (``(host, pid)`` as gathered), its descendants (compile and
    data workers) and its ancestors (torchrun, the launcher, the sweep that waits on it)."""
    host, own = socket.gethostname(), set()
    for rank_host, pid in rank_pids:
        if rank_host != host:
            continue
        try:
            process = psutil.Process(pid)
            own |= {pid, *(p.pid for p in process.children(recursive=True)), *(p.pid for p in process.parents())}
        except psutil.Error:
            own.add(pid)
    return own


def _name(pid: int, fallback: str = "?") -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return fallback


def gpu_processes(uuid: str) -> tuple[dict[int, tuple[str, float | None]], str]:
    """Compute processes on the GPU ``uuid`` (``GPU-...``): pid -> (name, MiB held), and how they were read."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                seen = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                return {
                    p.pid: (_name(p.pid), p.usedGpuMemory / _MIB if p.usedGpuMemory else None) for p in seen
                }, "nvml"
            finally:
                pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            _log.warning("NVML could not list the processes on %s (%s); trying nvidia-smi", uuid, exc)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}, "unavailable: neither pynvml nor nvidia-smi is installed"
    query = [smi, "--query-compute-apps=pid,process_name,used_memory,gpu_uuid", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return {}, f"unavailable: nvidia-smi failed ({exc})"
    found = {}
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[3] == uuid and fields[0].isdigit():
            memory = float(fields[2]) if fields[2].replace(".", "", 1).isdigit() else None
            found[int(fields[0])] = (_name(int(fields[0]), fields[1]), memory)
    return found, "nvidia-smi"


def _cpu_seconds(cores: set[int]) -> dict[int, tuple[str, float, float]]:
    """pid -> (name, CPU seconds so far, creation time) of every process that may run on ``cores``."""
    found = {}
    for process in psutil.process_iter(["name", "cpu_times", "cpu_affinity", "create_time"]):
        info = process.info
        if info["cpu_times"] is None or (info["cpu_affinity"] is not None and not cores & set(info["cpu_affinity"])):
            continue
        found[process.pid] = (
            info["name"] or "?",
            info["cpu_times"].user + info["cpu_times"].system,
            info["create_time"],
        )
    return found


class ContentionProbe:
    """One rank's samples: :meth:`start` as the measured steps begin, :meth:`stop` as they end.

    ``gpu_uuid``: the rank's GPU (``GPU-...``), None on a CPU run, which samples its cores instead."""

    def __init__(self, *, gpu_uuid: str | None, rank_pids: list[tuple[str, int]]):
        self.gpu_uuid, self.rank_pids = gpu_uuid, rank_pids
        self.own: set[int] = set()
        self.cores = set(os.sched_getaffinity(0))
        self.seen: dict[int, OtherProcess] = {}
        self.source = "not a GPU run" if gpu_uuid is None else "unsampled"
        self.began: float | None = None
        self.window_s = 0.0
        self._stopped = False
        self._cpu_start: dict[int, tuple[str, float, float]] = {}

    def _sample_gpu(self) -> None:
        if self.gpu_uuid is None:
            return
        found, self.source = gpu_processes(self.gpu_uuid)
        for pid, (name, mib) in found.items():
            if pid in self.own:
                continue
            known = self.seen.get(pid)
            held = max((m for m in (mib, known.gpu_memory_mib if known else None) if m is not None), default=None)
            self.seen[pid] = OtherProcess(pid=pid, name=name, where=f"gpu {self.gpu_uuid}", gpu_memory_mib=held)

    def start(self) -> None:
        self.began, self.own = time.time(), own_pids(self.rank_pids)
        self._sample_gpu()
        if self.gpu_uuid is None:
            self._cpu_start = _cpu_seconds(self.cores)

    def stop(self) -> None:
        """The window's end; once only (the trainer may end measuring before ``train.steps`` under
        ``train.target_cv``, and the worker then ends the window after the run)."""
        if self.began is None or self._stopped:
            return
        self._stopped = True
        self.own = own_pids(self.rank_pids)  # children started since (compile workers) are the trial's too
        self._sample_gpu()
        self.window_s = time.time() - self.began
        if self.gpu_uuid is None and self.window_s > 0:
            for pid, (name, seconds, created) in _cpu_seconds(self.cores).items():
                if pid in self.own:
                    continue
                if pid in self._cpu_start and self._cpu_start[pid][2] == created:
                    seconds -= self._cpu_start[pid][1]
                elif created < self.began:  # alive before the window but unseen at its start: no baseline
                    continue
                percent = 100 * seconds / self.window_s
                if percent >= CONTENDING_CPU_PERCENT:
                    self.seen[pid] = OtherProcess(pid=pid, name=name, where="cpu", cpu_percent=round(percent, 1))
        self.began = None

    def around(
        self,
        *,
        warmup_steps: int,
        steps: int,
        on_step: Callable[[int], None],
        on_measured: Callable[[float, Any], None],
    ) -> tuple[Callable[[int], None], Callable[[float, Any], None]]:
        """The trainer's ``on_step``/``on_measured`` callbacks, sampling as the first measured step begins and as
        the last one ends (its time taken), so the samples never fall inside a timed step."""
        measured = 0

        def step_hook(step: int) -> None:
            if step == warmup_steps and steps:
                self.start()
            on_step(step)

        def measured_hook(seconds: float, batch: Any) -> None:
            nonlocal measured
            on_measured(seconds, batch)
            measured += 1
            if measured == steps:
                self.stop()

        return step_hook, measured_hook

    def seen_by_rank(self) -> dict:
        """What this rank saw, as plain data for ``all_gather_object``."""
        return {
            "processes": [vars(p) for p in self.seen.values()],
            "source": self.source,
            "cores": sorted(self.cores),
            "window_s": self.window_s,
            "rank_pids": [pid for _, pid in self.rank_pids],
        }


def gathered_probe(device: str) -> ContentionProbe:
    """This rank's probe, knowing every rank's pid (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    rank_pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(rank_pids, (socket.gethostname(), os.getpid()))
    uuid = None
    if device == "cuda":
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        uuid = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
    return ContentionProbe(gpu_uuid=uuid, rank_pids=rank_pids)


def gathered_contention(probe: ContentionProbe) -> Contention:
    """Every rank's sightings, merged (a collective: every rank calls it)."""
    import torch.distributed as dist

    by_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, probe.seen_by_rank())
    return merge(by_rank)


def merge(by_rank: list[dict]) -> Contention:
    """Every rank's sightings as one record (rank 0's cores and window; a process seen twice is listed once)."""
    processes: dict[tuple[int, str], OtherProcess] = {}
    for seen in by_rank:
        for p in seen["processes"]:
            processes.setdefault((p["pid"], p["where"]), OtherProcess(**p))
    sources = sorted({seen["source"] for seen in by_rank})
    return Contention(
        processes=sorted(processes.values(), key=lambda p: (p.where, p.pid)),
        gpu_source=", ".join(sources),
        cores=by_rank[0]["cores"],
        cpu_threshold_percent=CONTENDING_CPU_PERCENT,
        window_s=by_rank[0]["window_s"],
        rank_pids=by_rank[0]["rank_pids"],
    )


def describe(processes: Sequence[OtherProcess]) -> str:
    """One line naming the other processes (``contention.processes`` of ``metrics.json``), for the worker's log,
    the sweep's progress line, MLflow tags and reports. Torch-free, so the sweep side can call it."""
    parts = []
    for p in processes:
        if p.cpu_percent is not None:
            use = f"{p.cpu_percent}% CPU"
        elif p.gpu_memory_mib is not None:
            use = f"{p.gpu_memory_mib:.0f} MiB"
        else:
            use = "memory not reported"
        parts.append(f"pid {p.pid} {p.name} ({p.where}, {use})")
    return "; ".join(parts)
