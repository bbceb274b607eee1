"""Each step's micro-batches built ahead, in DataLoader worker processes, while the device trains on the steps
before: how a real training loop keeps its GPU fed (Megatron's ``build_pretraining_data_loader`` hands torch's
``DataLoader`` a ``num_workers``).

The step timer never includes the fetch (``train/loop.py``), so this changes no measured step; it shortens the
trial, whose GPU otherwise idles while the host draws random pixels, decodes images or packs rows between steps
(``metrics.json``'s ``data_wait_s``: the fetch that is left). Worker processes rather than a thread: building a
batch holds the GIL in parts, and a thread would slow the training loop's host side, which is measured. For the
same reason no pinning thread runs in the trainer's process (DataLoader's ``pin_memory``): it would unpack and
pin the next steps during a timed one, and call into CUDA during a graph capture; the trainer's copy to the
device happens in the fetch, outside the timer.

A step crosses from the worker as one flat tensor per field (:func:`joined`), not one per micro-batch: torch
shares each tensor through a file descriptor held open while the step lives, and a step of a few hundred
micro-batches would otherwise run a process out of descriptors.

Steps are built in order, as the trainer asks for them, and are the same micro-batches the source gives
directly: every source draws a step from its seed and the step's index (``synthetic_images``) or reads its
shards in order, and one worker process per source keeps that order for a stateful reader.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from moe_vlm_sweep.config.schema import DataConf, ModelConf
from moe_vlm_sweep.data.batch import BatchSource, MicroBatch

logger = logging.getLogger(__name__)

PREFETCH_STEPS = 2
"""Steps each worker builds ahead (``DataLoader``'s ``prefetch_factor``): one to hand over, one in the making."""

_TENSORS = tuple(f.name for f in dataclasses.fields(MicroBatch) if f.name not in ("image_tokens", "cu_seqlens"))


@dataclass(frozen=True)
class JoinedStep:
    """A step's micro-batches as one flat tensor per field and each micro-batch's shapes."""

    flat: dict[str, torch.Tensor]
    shapes: list[dict[str, tuple[int, ...]]]
    image_tokens: int


def joined(microbatches: list[MicroBatch]) -> JoinedStep:
    """``microbatches`` with each field's tensors flattened end to end (``cu_seqlens`` too, where packed)."""
    fields = [*_TENSORS, *(("cu_seqlens",) if microbatches[0].packed else ())]
    return JoinedStep(
        flat={name: torch.cat([getattr(mb, name).reshape(-1) for mb in microbatches]) for name in fields},
        shapes=[{name: tuple(getattr(mb, name).shape) for name in fields} for mb in microbatches],
        image_tokens=microbatches[0].image_tokens,
    )


def split(step: JoinedStep) -> list[MicroBatch]:
    """The micro-batches of ``step``, each field a view of its flat tensor."""
    offsets = dict.fromkeys(step.flat, 0)
    out = []
    for shapes in step.shapes:
        views: dict[str, Any] = {}
        for name, shape in shapes.items():
            size = math.prod(shape)
            views[name] = step.flat[name][offsets[name] : offsets[name] + size].view(shape)
            offsets[name] += size
        out.append(MicroBatch(**views, image_tokens=step.image_tokens))
    return out


class _Steps(Dataset[JoinedStep]):
    """Step ``i`` of the source as a dataset item: the step's micro-batches, joined."""

    def __init__(self, source: BatchSource, num_microbatches: int):
        self.source, self.num_microbatches = source, num_microbatches

    def __getitem__(self, step: int) -> JoinedStep:
        return joined(self.source.step(step, self.num_microbatches))


class Prefetched:
    """``source``'s steps ``0, 1, ...`` from ``workers`` DataLoader worker processes. A step asked out of order,
    or with another micro-batch count, is an error: the workers build what comes next, never what is asked."""

    def __init__(self, source: BatchSource, *, num_microbatches: int, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"a prefetching source needs at least one worker process, got {workers}")
        self.realism, self.num_microbatches = source.realism, num_microbatches
        loader = DataLoader(
            _Steps(source, num_microbatches),
            batch_size=None,  # an item is a whole step: no collation
            sampler=itertools.count(),  # as many steps as the trainer asks for; close() stops the workers
            num_workers=workers,
            prefetch_factor=PREFETCH_STEPS,
            # the trainer's process may hold a CUDA context: the workers never touch CUDA, and fork keeps the
            # source as built (a spawned worker would have to pickle it)
            multiprocessing_context="fork",
            # the workers' base seed from a generator of their own: drawn from torch's global one, it would move
            # the model's initialization (the sources seed every sample themselves)
            generator=torch.Generator(),
        )
        steps = iter(loader)
        assert isinstance(steps, _MultiProcessingDataLoaderIter)  # num_workers >= 1
        self._steps = steps
        self._next = 0

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        if (step, num_microbatches) != (self._next, self.num_microbatches):
            raise ValueError(
                f"asked for step {step} of {num_microbatches} micro-batches; the workers build step {self._next} "
                f"of {self.num_microbatches}"
            )
        self._next += 1
        return split(next(self._steps))

    def close(self) -> None:
        """Stop the worker processes now. Dropping the iterator is not enough: after a worker's error the
        exception's traceback still holds it. ``_shutdown_workers`` is what the iterator's own ``__del__`` calls,
        and the only shutdown torch's DataLoader offers (PyTorch Lightning calls it the same way)."""
        self._steps._shutdown_workers()


SHARED_MEMORY = Path("/dev/shm")
"""Where torch's worker processes put the steps they hand over (a container's default is often 64 MB)."""


def step_bytes(model: ModelConf, *, micro_batch_size: int, num_microbatches: int) -> int:
    """An upper bound of one step's bytes as a worker hands it over: fp32 pixels and five int64-sized fields
    per text id."""
    size = model.vision.image_size
    sample = model.images_per_sample * 3 * size * size * 4 + 5 * model.text_tokens * 8
    return num_microbatches * micro_batch_size * sample


def no_room_for_workers(workers: int, bytes_per_step: int) -> str | None:
    """Why this process cannot give ``workers`` prefetching workers their room, or None: each needs a core
    besides the one the training rank runs on, and shared memory for the steps in flight."""
    cores = len(os.sched_getaffinity(0))
    if cores < 1 + workers:
        return f"{cores} core(s) in this process's CPU set, and each worker needs one besides the rank's"
    in_flight = (workers * PREFETCH_STEPS + 1) * bytes_per_step
    if SHARED_MEMORY.is_dir() and (free := shutil.disk_usage(SHARED_MEMORY).free) < in_flight:
        return (
            f"{free / 2**20:.0f} MiB free in {SHARED_MEMORY}, and the steps in flight need {in_flight / 2**20:.0f} MiB"
        )
    return None


@contextmanager
def prefetched(
    source: BatchSource, data: DataConf, model: ModelConf, *, device: str, micro_batch_size: int, num_microbatches: int
) -> Iterator[BatchSource]:
    """``source`` built ahead by ``data.loader_workers`` worker processes, or itself where there are none. The
    default (None: 1 on a GPU) falls back to none, with a warning, where this host has no core or shared memory to
    spare for them (:func:`no_room_for_workers`); a number the user set is used as set. The workers stop when the
    block ends, however it ends (a trial's process may leave with ``os._exit``, which skips the daemons'
    clean-up)."""
    workers = data.workers_on(device)
    if workers and data.loader_workers is None:
        bytes_per_step = step_bytes(model, micro_batch_size=micro_batch_size, num_microbatches=num_microbatches)
        if (why := no_room_for_workers(workers, bytes_per_step)) is not None:
            logger.warning("data.loader_workers: none, where its default is %d: %s", workers, why)
            workers = 0
    if not workers:
        yield source
        return
    ahead = Prefetched(source, num_microbatches=num_microbatches, workers=workers)
    try:
        yield ahead
    finally:
        ahead.close()
