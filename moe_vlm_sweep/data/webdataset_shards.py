"""``webdataset``: real image-caption pairs read from ``.tar`` shards with the ``webdataset`` loader.

A record is ``<key>.jpg|jpeg|png`` (the encoded image file) plus ``<key>.txt`` (its caption), the layout of
img2dataset's CC3M/LAION shards. Images are decoded and resized to ``model.vision.image_size`` (RGB, [0, 1]); a
sample takes ``model.images_per_sample`` consecutive records and joins their captions. Data-parallel rank r of d
reads records r, r + d, ...; the shards repeat endlessly.

What realism ``real_images`` means here, exactly: the pixels are real photographs, decoded and resized, and each
sample's text length (hence its padding, and what packing saves) is its real caption's. It does not mean real
tokens: no tokenizer is installed with the package, so a caption's text ids are its UTF-8 bytes
(:func:`caption_byte_ids`, byte b -> 1 + b mod (vocab_size - 1)), one id per byte, several times the ids a BPE
tokenizer would give; the run's token counts (``real_tokens_per_step``, ``effective_tokens_per_s``) count these
bytes plus the image tokens, as its ``accounting_notes`` say (:data:`TEXT_IDS`). Decoding and resizing run in the
loader's worker process where there is one (``data.loader_workers``: one on a GPU, none on the CPU; one at most
for shards, read in order), building the next steps while one trains, else on the training process when the
trainer fetches a step's micro-batches; either way before the step's timer starts, so the step times leave them
out, and ``data_wait_s`` in ``metrics.json`` records what is left to wait for, per measured step. Where it stays
near the step time, one reader cannot keep up with the step.
"""

from __future__ import annotations

import glob
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from moe_vlm_sweep.config.schema import ConfigFieldError, DataConf, ModelConf, row_layout
from moe_vlm_sweep.data.batch import FIRST_TEXT_ID, MicroBatch, layout

IMAGE_KEYS = "jpg;jpeg;png"


def shard_urls(pattern: str | None) -> list[str]:
    """``data.shards``: a brace pattern (``/d/{000..009}.tar``), a glob, or one path; every file must exist."""
    if not pattern:
        raise ConfigFieldError(
            "data.shards must name the .tar shards when data.name='webdataset' "
            "(e.g. data.shards='/data/cc3m/{000000..000099}.tar')"
        )
    urls = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else wds.shardlists.expand_urls(pattern)
    missing = [u for u in urls if not Path(u).is_file()]
    if not urls or missing:
        raise ConfigFieldError(
            f"data.shards={pattern!r} must name existing .tar shards; "
            f"{'missing: ' + ', '.join(missing[:3]) if missing else 'it matches no file'}"
        )
    return urls


TEXT_IDS = (
    "data=webdataset: text ids are a caption's UTF-8 bytes, one id per byte (no tokenizer), so text tokens, "
    "real_tokens_per_step and effective_tokens_per_s count caption bytes (plus image tokens), several times "
    "what a BPE tokenizer would count."
)
"""What a text id of this source is, for ``metrics.json``'s ``accounting_notes``."""


def caption_byte_ids(caption: str, vocab_size: int) -> torch.Tensor:
    """One id per UTF-8 byte of the stripped caption, in [1, vocab_size): byte ids, not tokenizer tokens."""
    data = np.frombuffer(caption.strip().encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return torch.from_numpy(FIRST_TEXT_ID + data % (vocab_size - FIRST_TEXT_ID))


def to_pixels(image: Image.Image, size: int) -> torch.Tensor:
    """[3, size, size] float in [0, 1]: RGB (grey and palette images converted), bicubic resize."""
    rgb = image.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    return torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1).contiguous()


class WebDatasetShards:
    """Micro-batches from real shards, in order; ``fixed_batch`` repeats the first step's batch."""

    realism = "real_images"

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        if model.images_per_sample < 1:
            raise ConfigFieldError(
                f"data.name='webdataset' needs model.images_per_sample >= 1, got "
                f"{model.images_per_sample} (use data=mock_text for text only)"
            )
        self.model, self.data, self.mbs = model, data, micro_batch_size
        self.urls = shard_urls(data.shards)
        self.records = itertools.islice(self._endless(), dp_rank, None, dp_size)
        self.fixed: list[MicroBatch] | None = None

    def _endless(self) -> Iterator[tuple[Image.Image, str]]:
        # nodesplitter=None: ranks are split by data-parallel rank below, not by torch.distributed rank (the
        # tensor- and pipeline-parallel peers of a replica must read the same records).
        dataset = (
            wds.WebDataset(self.urls, shardshuffle=False, nodesplitter=None).decode("pil").to_tuple(IMAGE_KEYS, "txt")
        )
        while True:
            count = 0
            for record in dataset:
                count += 1
                yield record
            if count == 0:
                raise ValueError(
                    f"data.shards={self.data.shards!r} holds no record with an image ({IMAGE_KEYS}) and a .txt caption"
                )

    def microbatch(self) -> MicroBatch:
        m = self.model
        n_img, row = row_layout(m, self.data)
        room = row - n_img
        images, texts = [], []
        for _ in range(self.mbs):
            records = [next(self.records) for _ in range(n_img)]
            images += [to_pixels(image, m.vision.image_size) for image, _ in records]
            caption = " ".join(text.strip() for _, text in records)
            texts.append(caption_byte_ids(caption, m.decoder.vocab_size)[:room])
        return layout(torch.stack(images), texts, images_per_sample=n_img, row_length=row, image_tokens=m.image_tokens)

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        if self.data.fixed_batch and self.fixed is not None:
            return self.fixed
        batches = [self.microbatch() for _ in range(num_microbatches)]
        if self.data.fixed_batch:
            self.fixed = batches
        return batches


def write_shards(records: Sequence[tuple[str, bytes, str, str]], pattern: str, *, per_shard: int) -> list[str]:
    """Write ``(key, encoded image bytes, extension, caption)`` records as shards ``pattern % index``, the
    layout the loader reads (tests and small local datasets)."""
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for key, image, ext, caption in records:
            sink.write({"__key__": key, ext: image, "txt": caption})
    return sorted(glob.glob(pattern.replace("%06d", "*")))
