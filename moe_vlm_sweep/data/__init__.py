"""Data sources for the training worker; each declares its ``realism`` (runs of different realism never rank
together): ``mock_text`` (no images), ``synthetic_images`` (random pixels), ``webdataset`` (real shards)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_vlm_sweep.config.schema import ConfigFieldError, DataConf, ModelConf
from moe_vlm_sweep.data.batch import IMAGE_TOKEN_INDEX, BatchSource, MicroBatch, Packed
from moe_vlm_sweep.data.mock_text import MockText
from moe_vlm_sweep.data.prefetch import PREFETCH_STEPS, Prefetched
from moe_vlm_sweep.data.synthetic import SyntheticImages

logger = logging.getLogger(__name__)

__all__ = [
    "IMAGE_TOKEN_INDEX",
    "BatchSource",
    "MicroBatch",
    "MockText",
    "Prefetched",
    "SyntheticImages",
    "make_source",
    "no_room_for_workers",
    "prefetched",
    "step_bytes",
    "text_ids_note",
]


def text_ids_note(data: DataConf) -> str | None:
    """What a text id of ``data``'s source counts, for ``accounting_notes``, where a token count would otherwise
    be read as a tokenizer's; None for the synthetic sources, whose ids stand for tokens by construction."""
    if data.name == "webdataset":
        from moe_vlm_sweep.data.webdataset_shards import TEXT_IDS

        return TEXT_IDS
    return None


def make_source(
    model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1
) -> BatchSource:
    """The source ``data.name`` selects, packed under ``data.packing``; refuses a ``data.realism`` that is not
    the source's own."""
    if data.name == "webdataset":  # imported here: only this source needs the webdataset package
        from moe_vlm_sweep.data.webdataset_shards import WebDatasetShards

        source: BatchSource = WebDatasetShards(
            model, data, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
    else:
        sources: dict[str, type[SyntheticImages | MockText]] = {
            "synthetic_images": SyntheticImages,
            "mock_text": MockText,
        }
        cls = sources[data.name]
        source = cls(model, data, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)
    if data.realism != source.realism:
        raise ConfigFieldError(
            f"data.realism={data.realism!r} must be {source.realism!r} for "
            f"data.name={data.name!r}: a run's realism is its source's, never relabelled"
        )
    return Packed(source) if data.packing else source


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
