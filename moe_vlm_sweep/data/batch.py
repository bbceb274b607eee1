"""The micro-batch every data source produces, in LLaVA's input convention, and the one place that lays it out.

Each sample is ``[<image> x images, text..., pad...]``: LLaVA replaces each ``<image>`` id (-200) by the image's
tokens, so a sample with ``n`` real text ids is ``n + images * (image_tokens - 1)`` real decoder tokens, and the
rest of the row is padding the model still computes on, unless the micro-batch is packed (:func:`pack`): then its
samples' real ids run back to back in one row that attention splits at ``cu_seqlens`` (TE's THD format, or a
block-causal mask for megatron's local attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from moe_vlm_sweep.config.schema import MIN_TEXT_IDS

IMAGE_TOKEN_INDEX = -200
"""LLaVA's image placeholder id (megatron.core.models.multimodal.llava_model.DEFAULT_IMAGE_TOKEN_INDEX)."""
PAD_TOKEN_ID = 0
FIRST_TEXT_ID = 1
"""Text ids are in [1, vocab_size): 0 is padding."""


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch in LLaVA's input convention (text ids with image placeholders, shifted labels)."""

    images: torch.Tensor
    """[mbs * images_per_sample, 3, image_size, image_size], sample-major; no rows for text-only data."""
    input_ids: torch.Tensor
    """[mbs, text_tokens]; image placeholders first, then text, then padding. Packed: [1, the samples' real ids]."""
    labels: torch.Tensor
    """Shaped as input_ids; labels[i] = input_ids[i + 1] within a sample (its last one is padding)."""
    loss_mask: torch.Tensor
    """Shaped as input_ids, float; 1 where labels[i] is a real text token."""
    position_ids: torch.Tensor
    """Shaped as input_ids, from 0 in each sample; RoPE positions are recomputed by the decoder, these only feed
    the embedding."""
    text_lengths: torch.Tensor
    """[mbs]; real (non-padding) text ids per sample, image placeholders included."""
    image_tokens: int
    """Decoder tokens one image becomes."""
    cu_seqlens: torch.Tensor | None = None
    """Packed micro-batches only: [mbs + 1] int32 offsets of each sample in the decoder row (images expanded)."""

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def block_causal_mask(self) -> torch.Tensor:
        """[1, 1, T, T] bool, True where a packed row's query may not see the key: another sample's, or a later
        one. What megatron's local attention (no THD) needs to keep samples apart; RoPE is relative, so scores
        within a sample do not depend on where the sample starts."""
        cu_seqlens = self.cu_seqlens
        assert cu_seqlens is not None  # asked of packed rows only
        sample = torch.repeat_interleave(
            torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device), torch.diff(cu_seqlens)
        )
        position = torch.arange(len(sample), device=sample.device)
        visible = (sample[:, None] == sample[None, :]) & (position[None, :] <= position[:, None])
        return ~visible[None, None]

    @property
    def images_per_sample(self) -> int:
        return self.images.shape[0] // self.text_lengths.shape[0]

    @property
    def decoder_lengths(self) -> torch.Tensor:
        """[mbs]; real decoder tokens per sample: real text plus every image's tokens (placeholders replaced)."""
        return self.text_lengths + self.images_per_sample * (self.image_tokens - 1)

    @property
    def padded_tokens(self) -> int:
        """Decoder tokens of the rows as laid out: every sample padded to the full sequence, or packed without
        padding."""
        rows, text = self.input_ids.shape
        return rows * text + self.images.shape[0] * (self.image_tokens - 1)

    @property
    def real_tokens(self) -> int:
        """Decoder tokens that are not padding: real text plus every image's tokens."""
        return int(self.decoder_lengths.sum())

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str, image_dtype: torch.dtype = torch.float32) -> MicroBatch:
        """On ``device``, pixels in the model's dtype (Float16Module casts positional inputs only)."""
        moved = {name: getattr(self, name).to(device) for name in ("input_ids", "labels", "loss_mask", "position_ids")}
        return MicroBatch(
            images=self.images.to(device, image_dtype),
            **moved,
            text_lengths=self.text_lengths,
            image_tokens=self.image_tokens,
            cu_seqlens=None if self.cu_seqlens is None else self.cu_seqlens.to(device),
        )


class BatchSource(Protocol):
    """What the trainer needs from a data source: the micro-batches of a step, and how real they are."""

    realism: str

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]: ...


def layout(
    images: torch.Tensor, texts: Sequence[torch.Tensor], *, images_per_sample: int, row_length: int, image_tokens: int
) -> MicroBatch:
    """Place each sample's text ids after its image placeholders, pad to ``row_length``, shift the labels.

    The loss covers labels that are real text: from the first text position (LLaVA masks image positions
    itself) up to the last real id, whose label would be padding.
    """
    mbs = len(texts)
    lengths = torch.tensor([images_per_sample + len(t) for t in texts])
    if (lengths > row_length).any() or (lengths < images_per_sample + MIN_TEXT_IDS).any():
        raise ValueError(
            f"each sample needs {MIN_TEXT_IDS} to {row_length - images_per_sample} text ids after "
            f"{images_per_sample} image placeholders, got {[len(t) for t in texts]}"
        )
    ids = torch.full((mbs, row_length), PAD_TOKEN_ID, dtype=torch.long)
    ids[:, :images_per_sample] = IMAGE_TOKEN_INDEX
    for row, text in zip(ids, texts):
        row[images_per_sample : images_per_sample + len(text)] = text
    positions = torch.arange(row_length).expand(mbs, row_length)
    labels = torch.cat([ids[:, 1:], torch.full((mbs, 1), PAD_TOKEN_ID)], dim=1)
    loss_mask = (positions >= images_per_sample) & (positions + 1 < lengths[:, None])
    return MicroBatch(
        images=images,
        input_ids=ids,
        labels=labels,
        loss_mask=loss_mask.float(),
        position_ids=positions.clone(),
        text_lengths=lengths,
        image_tokens=image_tokens,
    )


def pack(mb: MicroBatch) -> MicroBatch:
    """The micro-batch's samples back to back in one row, padding dropped (in-batch packing, as Megatron
    Bridge's ``pack_sequences_in_batch``): the decoder computes on real tokens only.

    Each sample keeps its own labels, loss mask and positions from 0; LLaVA expands every sample's image
    placeholders in place and masks the loss of the text just before an image, so no sample predicts the next
    one. ``cu_seqlens`` marks where each sample starts in the expanded row, for the attention.
    """
    if mb.packed:
        raise ValueError("the micro-batch is already packed")
    lengths = mb.text_lengths.tolist()

    def joined(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([row[:n] for row, n in zip(rows, lengths)])[None]

    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(mb.decoder_lengths, 0)
    return MicroBatch(
        images=mb.images,
        input_ids=joined(mb.input_ids),
        labels=joined(mb.labels),
        loss_mask=joined(mb.loss_mask),
        position_ids=joined(mb.position_ids),
        text_lengths=mb.text_lengths,
        image_tokens=mb.image_tokens,
        cu_seqlens=cu_seqlens,
    )


class Packed:
    """A source whose micro-batches are packed (``data.packing``); realism is the wrapped source's."""

    def __init__(self, source: BatchSource):
        self.source, self.realism = source, source.realism

    def step(self, step: int, num_microbatches: int) -> list[MicroBatch]:
        return [pack(mb) for mb in self.source.step(step, num_microbatches)]
