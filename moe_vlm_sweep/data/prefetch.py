"""Each step's micro-batches built ahead, in DataLoader worker processes, while the device trains on the steps
before: how a real training loop keeps its GPU fed (Megatron's ``build_pretraining_data_loader`` hands torch's
``DataLoader`` a ``num_workers``).

The step timer never includes the fetch (``train/loop.py``), so this changes no measured step; it shortens the
trial, whose GPU otherwise idles while the host draws random pixels, decodes images or packs rows between steps
(``metrics.json``'s ``data_wait_s``: the fetch that is left). Worker processes rather than a thread: building a
batch holds the GIL in parts, and a thread would slow the training loop's host side, which is measured.

Steps are built in order, as the trainer asks for them, and are the same micro-batches the source gives
directly: every source draws a step from its seed and the step's index (``synthetic_images``) or reads its
shards in order, and one worker process per source keeps that order for a stateful reader.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from moe_vlm_sweep.data.batch import BatchSource, MicroBatch

PREFETCH_STEPS = 2
"""Steps each worker builds ahead (``DataLoader``'s ``prefetch_factor``): one to hand over, one in the making."""


class _Steps(Dataset[list[MicroBatch]]):
    """Step ``i`` of the source as a dataset item: the step's micro-batches."""

    def __init__(self, source: BatchSource, num_microbatches: int):
        self.source, self.num_microbatches = source, num_microbatches

    def __getitem__(self, step: int) -> list[MicroBatch]:
        return self.source.step(step, self.num_microbatches)


class Prefetched:
    """``source``'s steps ``0, 1, ...`` from ``workers`` DataLoader worker processes, pinned for the copy to a
    GPU where ``pin_memory``. A step asked out of order, or with another micro-batch count, is an error: the
    workers build what comes next, never what is asked."""

    def __init__(self, source: BatchSource, *, num_microbatches: int, workers: int, pin_memory: bool) -> None:
        if workers < 1:
            raise ValueError(f"a prefetching source needs at least one worker process, got {workers}")
        self.realism, self.num_microbatches = source.realism, num_microbatches
        loader = DataLoader(
            _Steps(source, num_microbatches),
            batch_size=None,  # an item is a whole step: no collation
            sampler=itertools.count(),  # as many steps as the trainer asks for; close() stops the workers
            num_workers=workers,
            prefetch_factor=PREFETCH_STEPS,
            pin_memory=pin_memory,
            # the trainer's process may hold a CUDA context: the workers never touch CUDA, and fork keeps the
            # source as built (a spawned worker would have to pickle it)
            multiprocessing_context="fork",
            # the workers' base seed from a generator of their own: drawn from torch's global one, it would move
            # the model's initialization (the sources seed every sample themselves)
            generator=torch.Generator(),
        )
        self._steps: Iterator[list[MicroBatch]] = iter(loader)
        self._next = 0

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        if (step, num_microbatches) != (self._next, self.num_microbatches):
            raise ValueError(
                f"asked for step {step} of {num_microbatches} micro-batches; the workers build step {self._next} "
                f"of {self.num_microbatches}"
            )
        self._next += 1
        return next(self._steps)

    def close(self) -> None:
        """Stop the worker processes: the DataLoader's iterator shuts them down when it goes (they are daemons
        too, so a process that ends without this leaves none behind)."""
        self._steps = iter(())
