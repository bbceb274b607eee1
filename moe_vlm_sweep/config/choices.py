"""The closed vocabularies of the config's string fields, one ``StrEnum`` per field.

OmegaConf validates an Enum field when a config is composed (``train.precision=fp16`` is rejected with the allowed
values, before any ``__post_init__`` runs) and the dataclass codec when a plan is read back, so no group checks
these by hand. Each member's name is its value: OmegaConf looks a YAML or command-line string up by member name.
A member is a ``str``, so ``cfg.train.precision == "fp8"`` holds, JSON writes it as its value and the recipe
fingerprint of an unchanged config is unchanged.
"""

from __future__ import annotations

import enum


class Choice(enum.StrEnum):
    """A ``StrEnum`` whose ``repr`` is its value's (``'fp8'``), so error messages and lists of members read as the
    user wrote them."""

    def __repr__(self) -> str:
        return repr(self.value)


class VisionKind(Choice):
    """The ViT megatron-core's LLaVA builds: CLIP-style (class token, pre-norm) or SigLIP-style (no class
    token)."""

    clip = "clip"
    siglip = "siglip"


class ProjectorKind(Choice):
    """Vision-to-decoder projector: ``mlp`` (two layers with GELU, LLaVA-1.5) or ``affine`` (one linear layer)."""

    mlp = "mlp"
    affine = "affine"


class Normalization(Choice):
    """The decoder's norm, by megatron-core's ``TransformerConfig.normalization`` names."""

    RMSNorm = "RMSNorm"
    LayerNorm = "LayerNorm"


class FsdpSharding(Choice):
    """Megatron-FSDP's ``data_parallel_sharding_strategy``."""

    no_shard = "no_shard"
    optim = "optim"
    optim_grads = "optim_grads"
    optim_grads_params = "optim_grads_params"


class RecomputeGranularity(Choice):
    """megatron-core's ``recompute_granularity``, with ``none`` for no recompute."""

    none = "none"
    full = "full"
    selective = "selective"


class RecomputeMethod(Choice):
    """Full recompute's ``recompute_method``: chunks of layers (``uniform``) or the first layers of each
    pipeline stage (``block``)."""

    uniform = "uniform"
    block = "block"


class RecomputeModule(Choice):
    """megatron-core's ``recompute_modules`` names."""

    core_attn = "core_attn"
    moe_act = "moe_act"
    layernorm = "layernorm"
    mla_up_proj = "mla_up_proj"
    mlp = "mlp"
    moe = "moe"
    shared_experts = "shared_experts"


class CudaGraphImpl(Choice):
    """megatron-core's ``cuda_graph_impl``, with ``none`` for eager execution."""

    none = "none"
    local = "local"
    transformer_engine = "transformer_engine"
    full_iteration = "full_iteration"


class CudaGraphModule(Choice):
    """megatron-core's ``cuda_graph_modules`` names."""

    attn = "attn"
    mlp = "mlp"
    moe = "moe"
    moe_router = "moe_router"
    moe_preprocess = "moe_preprocess"
    mamba = "mamba"


class TokenDispatcher(Choice):
    """megatron-core's ``moe_token_dispatcher_type``."""

    allgather = "allgather"
    alltoall = "alltoall"
    flex = "flex"


class FlexBackend(Choice):
    """The flex dispatcher's all-to-all library (megatron-core's ``moe_flex_dispatcher_backend``)."""

    deepep = "deepep"
    hybridep = "hybridep"


class DataSource(Choice):
    """Where samples come from (``data/``): generated images with text, text alone shaped like the
    multimodal sequence, or WebDataset shards of captioned images."""

    synthetic_images = "synthetic_images"
    mock_text = "mock_text"
    webdataset = "webdataset"


class Realism(Choice):
    """How close the data is to real multimodal input; runs of different realism are never ranked together."""

    mock_text = "mock_text"
    synthetic_images = "synthetic_images"
    real_images = "real_images"


class Device(Choice):
    """What the worker trains on."""

    cpu = "cpu"
    cuda = "cuda"


class Launcher(Choice):
    """How the worker is started: one process in place, or ``torchrun`` per node."""

    local = "local"
    torchrun = "torchrun"


class TrackingBackend(Choice):
    """Where runs are recorded besides their run directory."""

    none = "none"
    mlflow = "mlflow"


class Precision(Choice):
    """Parameter and activation dtype; ``auto`` resolves per device (``TrainConf.resolved_precision``)."""

    auto = "auto"
    bf16 = "bf16"
    fp32 = "fp32"
    fp8 = "fp8"


class Fp8Recipe(Choice):
    """Transformer Engine's FP8 scaling recipes for Hopper, by megatron-core's names
    (``fp8_utils.get_fp8_recipe``)."""

    delayed = "delayed"
    tensorwise = "tensorwise"
    blockwise = "blockwise"


class TransformerImpl(Choice):
    """The layer specs: Transformer Engine's or megatron-core's local ones; ``auto`` resolves per device."""

    auto = "auto"
    local = "local"
    transformer_engine = "transformer_engine"
