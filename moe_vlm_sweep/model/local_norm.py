"""The vision encoder's norms where Transformer Engine is absent (CPU runs, or a GPU without TE).

CLIPViTModel's default pre/post norm is TENorm, or torch LayerNorm (which rejects megatron's ``config=`` argument)
without TE, and LLaVAModel gives no way to pass another. Building the model needs this on any machine without TE,
so it lives with the model builder rather than with the CPU patches (``train/cpu_compat.py`` calls it too).
"""

from __future__ import annotations

import functools
from typing import Any


def use_torch_norm_in_clip() -> None:
    """Make WrappedTorchNorm the default ``ln_pre_impl``/``ln_post_impl`` of CLIPViTModel (idempotent)."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = CLIPViTModel.__init__
    if getattr(original, "_torch_norm", False):
        return

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("ln_pre_impl", WrappedTorchNorm)
        kwargs.setdefault("ln_post_impl", WrappedTorchNorm)
        original(self, *args, **kwargs)

    vars(init)["_torch_norm"] = True  # a mark on the patched function (idempotence)
    CLIPViTModel.__init__ = init
