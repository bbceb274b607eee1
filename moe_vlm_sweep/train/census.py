"""What autograd saves for backward, per part of the model: the activations ``plan/memory.py`` estimates, measured.

A census step (an untimed one: the last warm-up step, ``train/loop.py: Trainer.schedule``) runs with
``torch.autograd.graph.saved_tensors_hooks`` on. Every tensor saved for backward until the step's first backward
unpacks one is counted once per storage (a view, or a tensor two nodes save, shares one), at the size the storage
has then (selective recompute frees some outputs after saving them), parameters and views of them excluded,
under the part of the model whose forward saved it. Under 1F1B that is every micro-batch in flight on this
stage: the activations held at the memory peak. Activation recompute saves again inside backward, after the
count ends, as its memory is transient.

It is a floor: a module that keeps a tensor as a ``ctx`` attribute instead of ``save_for_backward`` escapes the
hooks, and so do the layers a CUDA graph replays (the worker runs no census with graphs). Temporaries that live
only inside one op (the logits' fp32 copy in the loss, cuBLAS workspaces) are not saved tensors either.
"""

from __future__ import annotations

import math
import sys
import types
from collections import defaultdict
from typing import Any

import torch

CENSUS_PARTS = (
    "vision_encoder",
    "projector",
    "decoder.embedding",
    "decoder.layers.attention",
    "decoder.layers.mlp",
    "decoder.layers.other",
    "decoder.output",
    "other",
)
"""``decoder.layers.*`` add up to the estimate's ``decoder.layers``; ``decoder.output`` is the output layer and
the loss; ``other`` is the glue between modules (LLaVA's merge of image and text embeddings, the loss mask)."""


def _named_parts(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    lm: Any = chunk.language_model  # megatron's GPTModel
    parts: list[tuple[str, Any]] = [("vision_encoder", chunk.vision_model), ("projector", chunk.vision_projection)]
    if lm is not None:
        # The language model's own saves, outside its submodules, are the loss's (after the output layer)
        parts += [
            ("decoder.output", lm),
            ("decoder.layers.other", lm.decoder),
            ("decoder.embedding", getattr(lm, "embedding", None)),
            ("decoder.output", getattr(lm, "output_layer", None)),
        ]
        for layer in lm.decoder.layers:
            parts += [("decoder.layers.attention", layer.self_attention), ("decoder.layers.mlp", layer.mlp)]
    return [(name, module) for name, module in parts if module is not None]


_LIBRARIES = ("megatron", "transformer_engine", "moe_vlm_sweep")


def _saving_line() -> str:
    """The innermost model-library frame that saved the tensor (the op inside torch says less)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(lib in name for lib in _LIBRARIES) and not name.endswith("census.py"):
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class SavedTensorCensus:
    """A context manager around one training step; ``bytes`` then holds the saved bytes per ``CENSUS_PARTS`` and
    ``table()`` their largest sources."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.chunks = chunks
        self.bytes = {part: 0 for part in CENSUS_PARTS}
        self.sites: dict[tuple[str, str, str], list] = defaultdict(lambda: [0, 0, ()])
        """(part, saving source line, dtype) -> [tensors, bytes, largest shape]: where each part's bytes come from
        (per line, not per shape: each local expert's tokens differ)."""
        self._saved: dict[int, tuple[torch.Tensor, tuple[str, str, str]]] = {}
        self._weights: set[int] = set()
        self._stack: list[tuple[int, str]] = []
        self._handles: list = []
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._counting = True

    def _part(self) -> str:
        return self._stack[-1][1] if self._stack else "other"

    def _enter(self, name: str, module: torch.nn.Module, args) -> None:
        self._stack.append((id(module), name))

    def _leave(self, name: str, module: torch.nn.Module, args, output) -> None:
        while self._stack and self._stack.pop()[0] != id(module):
            pass

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if not self._counting or (base.is_leaf and base.requires_grad):  # a parameter, or a view of one
            return tensor
        try:  # keyed by the storage itself: an address is reused once selective recompute frees an output
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, TypeError):  # no plain storage (a wrapper or meta tensor)
            return tensor
        if key not in self._saved and key not in self._weights:
            self._saved[key] = (tensor, (self._part(), _saving_line(), str(tensor.dtype).removeprefix("torch.")))
        return tensor

    def _unpack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._counting:  # the first backward began: what is saved from now on is recompute, and transient
            self._counting = False
            self._tally()
        return tensor

    def _tally(self) -> None:
        """Sizes as they are when the first backward begins: a storage megatron freed after saving counts 0."""
        for tensor, (part, line, dtype) in self._saved.values():
            nbytes = tensor.untyped_storage().nbytes()
            self.bytes[part] += nbytes
            site = self.sites[(part, line, dtype)]
            site[0] += 1
            site[1] += nbytes
            site[2] = max(site[2], tuple(tensor.shape), key=math.prod)
        self._saved.clear()  # no reference of the census may keep an activation alive

    def table(self, rows: int = 80) -> str:
        """The largest sources of saved bytes, for finding what the memory estimate leaves out."""
        ranked = sorted(self.sites.items(), key=lambda item: -item[1][1])[:rows]
        lines = [
            f"{'MiB':>10}  {'tensors':>7}  {'part':<24}  {'dtype, largest shape':<32}  saved by",
            *(
                f"{nbytes / 2**20:10.2f}  {count:7d}  {part:<24}  {f'{dtype} {shape}':<32}  {line}"
                for (part, line, dtype), (count, nbytes, shape) in ranked
            ),
        ]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> SavedTensorCensus:
        # Parameters (and the buffers megatron's DDP keeps them in) are weights, not activations.
        self._weights = {p.untyped_storage()._cdata for chunk in self.chunks for p in chunk.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        try:
            for chunk in self.chunks:
                for name, module in _named_parts(chunk):
                    self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._enter(n, m, a)))
                    self._handles.append(module.register_forward_hook(lambda m, a, o, n=name: self._leave(n, m, a, o)))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        assert self._hooks is not None  # entered in __enter__, which exits through here on its own failure
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._counting:  # a step without backward (frozen everything) ends the count here
            self._counting = False
            self._tally()
        self._weights.clear()
