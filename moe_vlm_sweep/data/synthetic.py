"""``synthetic_images``: random pixels and random captions shaped like real LLaVA training samples.

Each sample is ``[<image> x images_per_sample, caption..., pad...]`` of ``model.text_tokens`` ids. The caption's
real length is drawn per sample, so padding is real and the real-token count differs from the padded one;
LLaVA replaces each ``<image>`` id (-200) by the image's patch embeddings, giving ``model.seq_length`` decoder
tokens per sample. Everything is drawn from a generator seeded by (data.seed, step, data-parallel rank,
micro-batch), so every rank of a tensor/pipeline group sees the same micro-batch without any broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_vlm_sweep.config.schema import DataConf, ModelConf

IMAGE_TOKEN_INDEX = -200
"""LLaVA's image placeholder id (megatron.core.models.multimodal.llava_model.DEFAULT_IMAGE_TOKEN_INDEX)."""
PAD_TOKEN_ID = 0
FIRST_TEXT_ID = 1
"""Caption ids are drawn from [1, vocab_size): 0 is padding."""


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch in LLaVA's input convention (text ids with image placeholders, shifted labels)."""

    images: torch.Tensor
    """[mbs * images_per_sample, 3, image_size, image_size], sample-major."""
    input_ids: torch.Tensor
    """[mbs, text_tokens]; image placeholders first, then caption, then padding."""
    labels: torch.Tensor
    """[mbs, text_tokens]; labels[i] = input_ids[i + 1] (the last one is padding)."""
    loss_mask: torch.Tensor
    """[mbs, text_tokens] float; 1 where labels[i] is a real caption token."""
    position_ids: torch.Tensor
    """[mbs, text_tokens]; RoPE positions are recomputed by the decoder, these only feed the embedding."""
    text_lengths: torch.Tensor
    """[mbs]; real (non-padding) text ids per sample, image placeholders included."""
    image_tokens: int
    """Decoder tokens one image becomes."""

    @property
    def padded_tokens(self) -> int:
        """Decoder tokens the model computes on: every sample is padded to the full sequence."""
        samples, text = self.input_ids.shape
        images_per_sample = self.images.shape[0] // samples
        return samples * (text + images_per_sample * (self.image_tokens - 1))

    @property
    def real_tokens(self) -> int:
        """Decoder tokens that are not padding: real text plus every image's tokens."""
        return int(self.text_lengths.sum()) + self.images.shape[0] * (self.image_tokens - 1)

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str, image_dtype: torch.dtype = torch.float32) -> "MicroBatch":
        """On ``device``, pixels in the model's dtype (Float16Module casts positional inputs only)."""
        moved = {name: getattr(self, name).to(device) for name in
                 ("input_ids", "labels", "loss_mask", "position_ids")}
        return MicroBatch(images=self.images.to(device, image_dtype), **moved, text_lengths=self.text_lengths,
                          image_tokens=self.image_tokens)


class SyntheticImages:
    """Deterministic source of micro-batches; ``fixed_batch`` makes every step see step 0's batch."""

    realism = "synthetic_images"

    def __init__(self, model: ModelConf, data: DataConf, *, micro_batch_size: int, dp_rank: int = 0):
        if model.text_tokens < model.images_per_sample + 2:
            raise ValueError(f"model.text_tokens={model.text_tokens} must leave room for "
                             f"model.images_per_sample={model.images_per_sample} placeholders and 2 caption ids")
        self.model, self.data = model, data
        self.mbs, self.dp_rank = micro_batch_size, dp_rank

    def microbatch(self, step: int, index: int) -> MicroBatch:
        step = 0 if self.data.fixed_batch else step
        gen = torch.Generator().manual_seed(hash((self.data.seed, step, self.dp_rank, index)) % (2**63))
        m, n_img, text = self.model, self.model.images_per_sample, self.model.text_tokens
        size = m.vision.image_size
        images = torch.rand(self.mbs * n_img, 3, size, size, generator=gen)
        fractions = torch.empty(self.mbs).uniform_(self.data.min_text_fraction, 1.0, generator=gen)
        lengths = (fractions * text).round().long().clamp(min=n_img + 2, max=text)
        ids = torch.randint(FIRST_TEXT_ID, m.decoder.vocab_size, (self.mbs, text), generator=gen)
        positions = torch.arange(text).expand(self.mbs, text)
        ids[:, :n_img] = IMAGE_TOKEN_INDEX
        ids[positions >= lengths[:, None]] = PAD_TOKEN_ID
        labels = torch.cat([ids[:, 1:], torch.full((self.mbs, 1), PAD_TOKEN_ID)], dim=1)
        # labels[i] = ids[i + 1] is caption text when i + 1 < length; from the last placeholder LLaVA masks
        # the loss itself (image positions), so the mask starts at the first caption position.
        loss_mask = (positions >= n_img) & (positions + 1 < lengths[:, None])
        return MicroBatch(images=images, input_ids=ids, labels=labels, loss_mask=loss_mask.float(),
                          position_ids=positions.clone(), text_lengths=lengths, image_tokens=m.image_tokens)

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        return [self.microbatch(step, i) for i in range(num_microbatches)]
