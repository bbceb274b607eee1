"""Data sources for the training worker; each declares its ``realism`` (runs of different realism never rank
together): ``mock_text`` (no images), ``synthetic_images`` (random pixels), ``webdataset`` (real shards)."""

from __future__ import annotations

from moe_vlm_sweep.config.schema import ConfigFieldError, DataConf, ModelConf
from moe_vlm_sweep.data.batch import IMAGE_TOKEN_INDEX, BatchSource, MicroBatch, Packed
from moe_vlm_sweep.data.mock_text import MockText
from moe_vlm_sweep.data.prefetch import Prefetched, no_room_for_workers, prefetched, step_bytes
from moe_vlm_sweep.data.synthetic import SyntheticImages

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
