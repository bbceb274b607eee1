"""CUDA graphs of LLaVA's MoE decoder layers: TE graphs captured after warmup the way Megatron-LM's training loop
does, and a check that megatron's ``local`` graphs really exist.

Megatron's ``TECudaGraphHelper`` looks for a ``decoder`` through the DDP/FSDP/Float16 wrappers of each chunk;
LLaVAModel keeps it one level down, in ``language_model`` (a GPTModel), so the helper would graph nothing. The
subclass points discovery at the GPT model and leaves everything else (sample inputs, rotary embeddings, the
pipeline order, TE ``make_graphed_callables``, the post-capture reset) to megatron-core. LLaVA also hides its
decoder from the schedules' per-micro-batch graph selection, so ``numbered`` sets it instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch
from megatron.core.transformer.cuda_graphs import TECudaGraphHelper, _CudagraphGlobalRecord
from megatron.core.utils import get_attr_wrapped_model

T = TypeVar("T")


def language_models(chunks: Iterable[torch.nn.Module]) -> list:
    """The GPTModel inside each (wrapped) LLaVA chunk, or None for a chunk without one."""
    return [get_attr_wrapped_model(chunk, "language_model") for chunk in chunks]


class LLaVADecoderGraphs(TECudaGraphHelper):
    """``TECudaGraphHelper`` that finds the decoder layers of LLaVA chunks (``chunk.language_model.decoder``)."""

    model: list[torch.nn.Module]

    def _discover_layers(self) -> None:
        wrapped = self.model
        # A chunk without a language model is handed over as itself: the helper finds no decoder, graphs nothing.
        self.model = [lm if lm is not None else chunk for lm, chunk in zip(language_models(wrapped), wrapped)]
        try:
            super()._discover_layers()
        finally:
            self.model = wrapped  # the post-capture reset zeroes the wrappers' grad buffers

    def capture(self) -> int:
        """Capture every graphable decoder layer; returns how many layers were graphed (0 raises: a graph
        scope that graphs nothing would be measured as if it had)."""
        self.create_cudagraphs()
        if not self.graphs_created():
            raise RuntimeError(
                f"cuda_graph.modules={self.config.cuda_graph_modules}: no decoder layer of this "
                "model is graphable under that scope"
            )
        return len(self.flattened_callables)


def local_graphed_layers(chunks: Iterable[torch.nn.Module]) -> int:
    """Decoder layers under ``cuda_graph.impl=local`` whose graphs megatron created at the end of the first
    step; 0 raises, for the same reason as :meth:`LLaVADecoderGraphs.capture`."""
    layers = [
        layer
        for lm in language_models(chunks)
        if lm is not None
        for layer in lm.decoder.layers
        if hasattr(layer, "cudagraph_manager")
    ]
    if not layers or not _CudagraphGlobalRecord.cudagraph_created:
        raise RuntimeError(
            "cuda_graph.impl=local: megatron-core created no CUDA graph of any decoder layer in the first step"
        )
    return len(layers)


def numbered[T](microbatches: Iterable[T], chunk: torch.nn.Module) -> Iterator[T]:
    """Yield the micro-batches of one chunk, telling its decoder layers which one runs next: a TE-graphed layer
    replays the graph (and static buffers) of that micro-batch, as megatron's ``set_current_microbatch`` does
    for GPT models."""
    lm = language_models([chunk])[0]
    layers = list(lm.decoder.layers) if lm is not None else []
    for index, microbatch in enumerate(microbatches):
        for layer in layers:
            layer.current_microbatch = index
        yield microbatch
