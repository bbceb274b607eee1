"""``synthetic_images``: random pixels and random captions shaped like real LLaVA training samples.

Each sample is ``[<image> x images_per_sample, caption..., pad...]`` of ``model.text_tokens`` ids. The caption's
real length is drawn per sample, so padding is real and the real-token count differs from the padded one.
Each sample is drawn from its own generator, seeded by (data.seed, step, the sample's index in the global batch),
so every rank of a tensor/pipeline group sees the same micro-batch without any broadcast, and a step's global
batch is the same samples under any layout (dp, mbs): ``moe-vlm-sweep verify`` compares two layouts' loss and
gradient-norm curves on the same batches.
"""

from __future__ import annotations

import torch

from moe_vlm_sweep.config.schema import MIN_TEXT_IDS, DataConf, ModelConf, row_layout
from moe_vlm_sweep.data.batch import FIRST_TEXT_ID, IMAGE_TOKEN_INDEX, PAD_TOKEN_ID, MicroBatch, layout

__all__ = ["FIRST_TEXT_ID", "IMAGE_TOKEN_INDEX", "PAD_TOKEN_ID", "MicroBatch", "SyntheticImages", "SyntheticRows"]


class SyntheticRows:
    """Deterministic random rows of ``row_length`` ids after ``images_per_sample`` random images, as
    ``row_layout`` lays out ``data.name``; the shared part of ``synthetic_images`` and ``mock_text``.
    ``fixed_batch`` makes every step see step 0's batch."""

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1):
        images_per_sample, row_length = row_layout(model, data)
        if row_length < images_per_sample + MIN_TEXT_IDS:
            raise ValueError(
                f"model.text_tokens={row_length} must leave room for model.images_per_sample="
                f"{images_per_sample} placeholders and {MIN_TEXT_IDS} caption ids"
            )
        self.model, self.data = model, data
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.images_per_sample, self.row_length = images_per_sample, row_length

    def sample_index(self, index: int, row: int) -> int:
        """Global index of row ``row`` of micro-batch ``index`` on this DP rank, as Megatron's pretraining sampler
        deals a global batch: each micro-batch round takes ``mbs * dp`` consecutive samples, rank r the r-th
        ``mbs`` of them."""
        return (index * self.dp_size + self.dp_rank) * self.mbs + row

    def microbatch(self, step: int, index: int) -> MicroBatch:
        step = 0 if self.data.fixed_batch else step
        n_img, size = self.images_per_sample, self.model.vision.image_size
        room = self.row_length - n_img
        images, texts = [], []
        for row in range(self.mbs):
            key = (self.data.seed, step, self.sample_index(index, row))
            gen = torch.Generator().manual_seed(hash(key) % (2**63))
            images.append(torch.rand(n_img, 3, size, size, generator=gen))
            fraction = float(torch.empty(1).uniform_(self.data.min_text_fraction, 1.0, generator=gen))
            filled = min(max(round(fraction * self.row_length), n_img + MIN_TEXT_IDS), self.row_length)
            ids = torch.randint(FIRST_TEXT_ID, self.model.decoder.vocab_size, (room,), generator=gen)
            texts.append(ids[: filled - n_img])
        return layout(
            torch.cat(images),
            texts,
            images_per_sample=n_img,
            row_length=self.row_length,
            image_tokens=self.model.image_tokens,
        )

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        return [self.microbatch(step, i) for i in range(num_microbatches)]


class SyntheticImages(SyntheticRows):
    """Random pixels at the model's image size and count; captions of variable length within ``text_tokens``."""

    realism = "synthetic_images"
