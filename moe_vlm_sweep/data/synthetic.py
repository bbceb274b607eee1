"""``synthetic_images``: random pixels and random captions shaped like real LLaVA training samples.

Each sample is ``[<image> x images_per_sample, caption..., pad...]`` of ``model.text_tokens`` ids. The caption's
real length is drawn per sample, so padding is real and the real-token count differs from the padded one.
Everything is drawn from a generator seeded by (data.seed, step, data-parallel rank, micro-batch), so every rank
of a tensor/pipeline group sees the same micro-batch without any broadcast.
"""

from __future__ import annotations

import torch

from moe_vlm_sweep.config.schema import MIN_TEXT_IDS, DataConf, ModelConf, row_layout
from moe_vlm_sweep.data.batch import FIRST_TEXT_ID, IMAGE_TOKEN_INDEX, PAD_TOKEN_ID, MicroBatch, layout

__all__ = ["FIRST_TEXT_ID", "IMAGE_TOKEN_INDEX", "PAD_TOKEN_ID", "MicroBatch", "SyntheticImages", "SyntheticRows"]


class SyntheticRows:
    """Deterministic random rows of ``row_length`` ids after ``images_per_sample`` random images; the shared
    part of ``synthetic_images`` and ``mock_text``. ``fixed_batch`` makes every step see step 0's batch."""

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0,
                 images_per_sample: int, row_length: int):
        if row_length < images_per_sample + MIN_TEXT_IDS:
            raise ValueError(f"model.text_tokens={row_length} must leave room for model.images_per_sample="
                             f"{images_per_sample} placeholders and {MIN_TEXT_IDS} caption ids")
        self.model, self.data = model, data
        self.mbs, self.dp_rank = micro_batch_size, dp_rank
        self.images_per_sample, self.row_length = images_per_sample, row_length

    def microbatch(self, step: int, index: int) -> MicroBatch:
        step = 0 if self.data.fixed_batch else step
        gen = torch.Generator().manual_seed(hash((self.data.seed, step, self.dp_rank, index)) % (2**63))
        n_img, size = self.images_per_sample, self.model.vision.image_size
        images = torch.rand(self.mbs * n_img, 3, size, size, generator=gen)
        room = self.row_length - n_img
        fractions = torch.empty(self.mbs).uniform_(self.data.min_text_fraction, 1.0, generator=gen)
        filled = (fractions * self.row_length).round().long().clamp(min=n_img + MIN_TEXT_IDS, max=self.row_length)
        lengths = filled - n_img
        ids = torch.randint(FIRST_TEXT_ID, self.model.decoder.vocab_size, (self.mbs, room), generator=gen)
        return layout(images, [row[:n] for row, n in zip(ids, lengths)], images_per_sample=n_img,
                      row_length=self.row_length, image_tokens=self.model.image_tokens)

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        return [self.microbatch(step, i) for i in range(num_microbatches)]


class SyntheticImages(SyntheticRows):
    """Random pixels at the model's image size and count; captions of variable length within ``text_tokens``."""

    realism = "synthetic_images"

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0):
        images, row = row_layout(model, data)
        super().__init__(model, data, micro_batch_size=micro_batch_size, dp_rank=dp_rank, images_per_sample=images,
                         row_length=row)
