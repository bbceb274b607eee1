"""What the training loop measures, each as a context manager around the steps it covers: the step's time between
two device syncs, the wall clock of each part of the schedule, the collector's pauses and its manual control, and the
profile steps' per-component split and trace.

They are kept apart from the loop so that a step is only ``zero grads, forward-backward, optimizer step``: nothing
here patches megatron or the optimizer. The split comes from module hooks (the three components) and from marks
the trainer makes itself around the gradient finalization (megatron's ``finalize_model_grads_func`` callback) and
the optimizer step, which are no-ops outside the profile steps.
"""

from __future__ import annotations

import contextlib
import gc
import re
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

_NO_SPAN = contextlib.nullcontext()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def wall(wall_s: dict[str, float], part: str) -> Iterator[None]:
    """Adds the block's wall-clock seconds (data, reductions and syncs included) to ``wall_s[part]``."""
    began = time.perf_counter()
    yield
    wall_s[part] = wall_s.get(part, 0.0) + time.perf_counter() - began


class GcPauses:
    """Counts the collector's pauses while ``timing`` is set: a ``gc.callbacks`` entry while entered."""

    def __init__(self) -> None:
        self.timing, self.count, self.seconds = False, 0, 0.0
        self._began: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            if self.timing:
                self.count, self.seconds = self.count + 1, self.seconds + time.perf_counter() - self._began
            self._began = None

    def summary(self) -> dict[str, float]:
        """``count`` and ``seconds`` of the pauses counted (``TrainResult.gc_in_measured_steps``)."""
        return {"count": self.count, "seconds": self.seconds}


class ManualGc:
    """``train.manual_gc``: one collection before the first step past warm-up, then the collector off for the rest of
    the run (as Megatron-LM's ``--manual-gc``), and back on however the run ends."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __enter__(self) -> ManualGc:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            gc.enable()

    def before(self, phase: str) -> None:
        if self.enabled and phase != "warmup" and gc.isenabled():
            gc.collect()
            gc.disable()


class StepTimer:
    """One step's seconds between two device syncs, as a slowest-rank measurement needs; the collector's pauses in
    between are counted when ``count_gc``."""

    def __init__(self, device: str, pauses: GcPauses, *, count_gc: bool) -> None:
        self.device, self.pauses, self.count_gc = device, pauses, count_gc
        self.seconds = 0.0

    def __enter__(self) -> StepTimer:
        sync(self.device)
        self._start, self.pauses.timing = time.perf_counter(), self.count_gc
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            sync(self.device)
            self.seconds = time.perf_counter() - self._start
        self.pauses.timing = False


class PhaseMarks:
    """Marks when each part of a profile step starts (synchronizing first); a part lasts until the next mark.
    Inactive (no marks, no syncs) outside the profile steps."""

    def __init__(self, device: str) -> None:
        self.device, self.active = device, False
        self.events: list[tuple[float, str]] = []

    def mark(self, phase: str) -> None:
        sync(self.device)
        self.events.append((time.perf_counter(), phase))

    def span(self, phase: str) -> contextlib.AbstractContextManager:
        """``phase`` for the block, ``other`` after it: what the trainer wraps gradient sync and the optimizer in."""
        return self._span(phase) if self.active else _NO_SPAN

    @contextlib.contextmanager
    def _span(self, phase: str) -> Iterator[None]:
        self.mark(phase)
        yield
        self.mark("other")

    def seconds(self) -> dict[str, float]:
        """Per phase, seconds summed over profiling steps; the gap after each step's ``end`` mark is dropped."""
        totals: dict[str, float] = {}
        for (t0, phase), (t1, _) in zip(self.events, self.events[1:]):
            if phase != "end":
                totals[phase] = totals.get(phase, 0.0) + t1 - t0
        return totals


def _hook_components(chunks: list[torch.nn.Module], marks: PhaseMarks) -> list[RemovableHandle]:
    """Forward pre/post hooks and output-gradient hooks on the three components of every local chunk."""
    handles: list[RemovableHandle] = []

    def after_forward(name: str, module: Any, args: Any, output: Any) -> None:
        marks.mark("other")
        out = output[0] if isinstance(output, tuple) else output
        if torch.is_tensor(out) and out.requires_grad:
            out.register_hook(lambda grad: marks.mark(f"{name}.backward"))

    for chunk in chunks:
        for name, attr in (
            ("vision_encoder", "vision_model"),
            ("projector", "vision_projection"),
            ("decoder", "language_model"),
        ):
            module = getattr(chunk, attr)
            if module is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda m, a, n=name: marks.mark(f"{n}.forward")))
            handles.append(module.register_forward_hook(partial(after_forward, name)))
    return handles


def _profiler(device: str, stacks: bool = True) -> torch.profiler.profile:
    """``stacks``: the Python frames of each op, so copies and casts can be traced to the code that made them
    (the verbose config is what fills each event's stack in torch's Kineto profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if not stacks:
        return torch.profiler.profile(activities=activities)
    return torch.profiler.profile(
        activities=activities, with_stack=True, experimental_config=torch.profiler._ExperimentalConfig(verbose=True)
    )


# Ops that move or cast memory without computing: where a kernel-bound step's avoidable time hides.
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::index_select")


def _call_site(event) -> tuple[str, ...]:
    """Where an op came from: the autograd function whose backward ran it (a backward op's Python stack is only
    the engine's), else the innermost Python frames of the op or of its nearest caller op that has them (a
    bound method's frame names its object's address, dropped so that one call site is one row)."""
    ancestor = event
    while ancestor is not None:
        if ancestor.name.startswith("autograd::engine::evaluate_function: "):
            return ("backward of " + ancestor.name.rsplit(": ", 1)[1],)
        if ancestor.stack:
            via = () if ancestor is event else (f"inside {ancestor.name}",)
            return via + tuple(re.sub(r" at 0x[0-9a-f]+", "", frame) for frame in ancestor.stack[:6])
        ancestor = ancestor.cpu_parent
    return ("(no caller recorded: an op issued from C++ alone)",)


def _write_trace(profiler: torch.profiler.profile, trace_dir: Path, device: str, prefix: str = "") -> None:
    """``trace.json`` (open in Perfetto or chrome://tracing), ``kernels.txt`` (ops by self device time),
    ``host_ops.txt`` (ops by self CPU time: what the host did, launches and plan builds included) and, from a
    profile with Python stacks, ``copies.txt`` (the copy and cast ops of ``COPY_OPS`` grouped by the Python call site
    that issued them), each name after ``prefix``."""
    profiler.export_chrome_trace(str(trace_dir / f"{prefix}trace.json"))
    averages = profiler.key_averages()
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    (trace_dir / f"{prefix}kernels.txt").write_text(averages.table(sort_by=sort, row_limit=40) + "\n")
    host = averages.table(sort_by="self_cpu_time_total", row_limit=40)
    (trace_dir / f"{prefix}host_ops.txt").write_text(host + "\n")
    if not profiler.with_stack:
        return
    sites: dict[tuple[str, tuple[str, ...]], list[float]] = {}
    for e in profiler.events():
        if e.name in COPY_OPS:
            site = sites.setdefault((e.name, _call_site(e)), [0.0, 0])
            site[0] += e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
            site[1] += 1
    total = sum(own for own, _ in sites.values())
    lines = [f"copy and cast ops by call site ({device} self time, all profiled steps): {total / 1e3:.1f} ms"]
    for (op, frames), (own, count) in sorted(sites.items(), key=lambda item: -item[1][0])[:30]:
        lines.append(f"\n{own / 1e3:9.2f} ms  {count:6d} calls  {op}")
        lines += [f"    {frame}" for frame in frames]
    (trace_dir / f"{prefix}copies.txt").write_text("\n".join(lines) + "\n")


FIRST_STEP = "first_step_"
"""The prefix of the first step's trace files (``train.trace_first_step``) beside the profile steps' own."""


@contextlib.contextmanager
def first_step_trace(trace_dir: Path | None, device: str) -> Iterator[None]:
    """torch.profiler over one step (``train.trace_first_step``), written as :func:`_write_trace` writes the
    profile steps' trace, under the ``first_step_`` prefix, when the step ended normally. No-op without a
    ``trace_dir``.

    Without Python stacks: the first step is where torch.compile traces and generates the fused functions' code
    and Triton autotunes, a flood of host ops whose stacks would make the traced step a different, far slower one
    (``benchmarks/results/README.md``, "H100: the first step traced"). What the first step pays is read by op names
    and kernels; the copies' call sites are the profile steps' question."""
    if trace_dir is None:
        yield
        return
    with _profiler(device, stacks=False) as profiler:
        yield
    _write_trace(profiler, trace_dir, device, prefix=FIRST_STEP)


class Profiling:
    """The profile steps' measurement, started at the first of them and kept on to the end of the run (they come
    last): torch.profiler when there is a ``trace_dir``, and the per-component split (hooks on the components, the
    trainer's marks made active). Leaving it removes the hooks and stops the profiler; a run that ended normally
    writes its trace."""

    def __init__(self, chunks: list[torch.nn.Module], marks: PhaseMarks, trace_dir: Path | None) -> None:
        self.chunks, self.marks, self.trace_dir = chunks, marks, trace_dir
        self._stack = contextlib.ExitStack()
        self._profiler: torch.profiler.profile | None = None
        self._hooked = False

    def __enter__(self) -> Profiling:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._stack.close()
        if exc_type is None and self._profiler is not None and self.trace_dir is not None:
            _write_trace(self._profiler, self.trace_dir, self.marks.device)

    def before(self, phase: str) -> None:
        """Before the step's data: the trace starts with the first profile step."""
        if phase == "profile" and self.trace_dir is not None and self._profiler is None:
            self._profiler = self._stack.enter_context(_profiler(self.marks.device))

    @contextlib.contextmanager
    def step(self, phase: str) -> Iterator[None]:
        """Around a profile step's timed part: its parts marked from ``other`` to ``end``."""
        if phase != "profile":
            yield
            return
        if not self._hooked:
            self._hooked = True
            for handle in _hook_components(self.chunks, self.marks):
                self._stack.callback(handle.remove)
            self.marks.active = True
            self._stack.callback(setattr, self.marks, "active", False)
        self.marks.mark("other")
        yield
        self.marks.mark("end")

    def split_seconds(self, steps: int) -> dict[str, float] | None:
        """Mean seconds per profile step per part, or None without profile steps."""
        return {k: v / steps for k, v in self.marks.seconds().items()} if steps else None
