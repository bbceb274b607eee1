"""Typed configuration: one kw_only dataclass per Hydra group.

Each ``__post_init__`` checks only its own fields (the torchtitan rule); rules that relate two groups live in
``moe_vlm_sweep.plan.rules``. This module imports neither Hydra nor torch, so the training worker can rebuild a
``RunConfig`` from the plan file with :func:`from_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_vlm_sweep.config import codec
from moe_vlm_sweep.config.choices import (
    CudaGraphImpl,
    CudaGraphModule,
    DataSource,
    Device,
    FlexBackend,
    Fp8Recipe,
    FsdpSharding,
    Launcher,
    Normalization,
    Precision,
    ProjectorKind,
    Realism,
    RecomputeGranularity,
    RecomputeMethod,
    RecomputeModule,
    TokenDispatcher,
    TrackingBackend,
    TransformerImpl,
    VisionKind,
)


class ConfigFieldError(ValueError):
    """A field holds a value outside its own domain (raised while a group is built)."""


def _choice(knob: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """For the closed choices an Enum cannot hold: OmegaConf 2.3 looks an Enum member up by name, so neither int
    values (``model.vision.spatial_merge``) nor a value that is no identifier (``parallel.strategy=3d``) fits one,
    and it has no ``Literal`` type. Every other closed choice is a ``StrEnum`` (``config/choices.py``)."""
    if value not in allowed:
        raise ConfigFieldError(f"{knob}={value!r} must be one of {', '.join(map(str, allowed))}")


def _positive(knob: str, value: int | float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigFieldError(f"{knob}={value} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass(kw_only=True)
class VisionEncoderConf:
    """The ViT. megatron-core's LLaVA drives a CLIP-style ViT (``clip``) or a SigLIP-style one (``siglip``)."""

    kind: VisionKind = VisionKind.clip
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int = 128
    patch_size: int = 14
    image_size: int = 56
    class_token_len: int = 1
    """CLS tokens prepended by CLIP; they are dropped before the projector (LLaVA's default)."""
    spatial_merge: int = 1
    """2 merges each 2x2 patch block into one token before the projector (Qwen-VL's patch merger; megatron-core
    LLaVA's ``pixel_shuffle``), so an image costs a quarter of the decoder tokens."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "patch_size", "image_size"):
            _positive(f"model.vision.{name}", getattr(self, name))
        _positive("model.vision.class_token_len", self.class_token_len, allow_zero=True)
        _choice("model.vision.spatial_merge", self.spatial_merge, (1, 2))
        if self.image_size % self.patch_size:
            raise ConfigFieldError(
                f"model.vision.image_size={self.image_size} must be a multiple of "
                f"model.vision.patch_size={self.patch_size}"
            )

    @property
    def patches_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Tokens one image contributes to the decoder (CLS tokens are dropped, merged patches count once)."""
        return self.patches_per_image // self.spatial_merge**2


@dataclass(kw_only=True)
class ProjectorConf:
    kind: ProjectorKind = ProjectorKind.mlp
    """``mlp`` (two layers with GELU, LLaVA-1.5) or ``affine``."""
    ffn_hidden_size: int | None = None
    """Hidden width of the MLP projector; None means the decoder's hidden size."""

    def __post_init__(self) -> None:
        _positive("model.projector.ffn_hidden_size", self.ffn_hidden_size)


@dataclass(kw_only=True)
class DecoderConf:
    """The MoE GPT decoder (megatron-core ``GPTModel`` inside ``LLaVAModel``)."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int | None = None
    """Head dimension; None means hidden_size / num_attention_heads."""
    ffn_hidden_size: int = 128
    """Dense FFN width, used by layers that are not MoE."""
    num_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 64
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int = 1
    """Every n-th layer is MoE (1: all layers)."""
    moe_aux_loss_coeff: float = 1e-2
    vocab_size: int = 512
    rotary_base: int = 10000
    normalization: Normalization = Normalization.RMSNorm

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_layer_freq",
            "vocab_size",
            "kv_channels",
            "moe_shared_expert_intermediate_size",
        ):
            _positive(f"model.decoder.{name}", getattr(self, name))
        if self.moe_router_topk > self.num_experts:
            raise ConfigFieldError(
                f"model.decoder.moe_router_topk={self.moe_router_topk} must be <= "
                f"model.decoder.num_experts={self.num_experts}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigFieldError(
                f"model.decoder.num_query_groups={self.num_query_groups} must divide "
                f"model.decoder.num_attention_heads={self.num_attention_heads}"
            )
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ConfigFieldError(
                f"model.decoder.num_attention_heads={self.num_attention_heads} must divide "
                f"model.decoder.hidden_size={self.hidden_size} (or set model.decoder.kv_channels)"
            )

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def num_moe_layers(self) -> int:
        return sum(1 for i in range(self.num_layers) if i % self.moe_layer_freq == 0)


@dataclass(kw_only=True)
class ModelConf:
    name: str = "tiny"
    vision: VisionEncoderConf = field(default_factory=VisionEncoderConf)
    projector: ProjectorConf = field(default_factory=ProjectorConf)
    decoder: DecoderConf = field(default_factory=DecoderConf)
    images_per_sample: int = 1
    text_tokens: int = 64
    """Text tokens per sample (caption + prompt), before image tokens are inserted."""

    def __post_init__(self) -> None:
        _positive("model.images_per_sample", self.images_per_sample, allow_zero=True)
        _positive("model.text_tokens", self.text_tokens)

    @property
    def image_tokens(self) -> int:
        """Tokens one image contributes to the decoder sequence (patches; CLS tokens are dropped)."""
        return self.vision.tokens_per_image

    @property
    def seq_length(self) -> int:
        """Decoder sequence: each image placeholder token is replaced by the image's tokens."""
        return self.text_tokens + self.images_per_sample * (self.image_tokens - 1)


@dataclass(kw_only=True)
class ParallelConf:
    """FSDP (Megatron-FSDP) or 3D (Megatron DDP + distributed optimizer); DP is what the world leaves."""

    strategy: str = "fsdp"
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank; 1 means no interleaving."""
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    fsdp_sharding: FsdpSharding = FsdpSharding.optim_grads_params
    overlap_grad_reduce: bool = False
    """Reduce each data-parallel gradient bucket as soon as backward fills it, overlapping the communication with
    the rest of backward (megatron's DDP and Megatron-FSDP), instead of one reduction after the last micro-batch."""
    overlap_param_gather: bool = False
    """Gather the distributed optimizer's updated parameters bucket by bucket in the next step's forward, instead of
    all at once after the optimizer step. Megatron-LM's trainer accepts it only with ``overlap_grad_reduce``;
    megatron-core runs it either way, so no rule refuses it (the multi-GPU spaces pair them)."""

    def __post_init__(self) -> None:
        _choice("parallel.strategy", self.strategy, ("fsdp", "3d"))
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp"):
            _positive(f"parallel.{name}", getattr(self, name))


@dataclass(kw_only=True)
class BatchConf:
    mbs: int = 2
    gbs: int = 4

    def __post_init__(self) -> None:
        _positive("batch.mbs", self.mbs)
        _positive("batch.gbs", self.gbs)


@dataclass(kw_only=True)
class RecomputeConf:
    granularity: RecomputeGranularity = RecomputeGranularity.none
    modules: list[RecomputeModule] = field(default_factory=list)
    """Selective recompute only; megatron-core's names."""
    method: RecomputeMethod | None = None
    """Full recompute only: ``uniform`` or ``block``."""
    num_layers: int | None = None
    """Full recompute only: layers per chunk (uniform) or recomputed layers per stage (block)."""

    def __post_init__(self) -> None:
        _positive("recompute.num_layers", self.num_layers)


@dataclass(kw_only=True)
class CudaGraphConf:
    scope: str = "none"
    impl: CudaGraphImpl = CudaGraphImpl.none
    modules: list[CudaGraphModule] = field(default_factory=list)
    """megatron-core ``cuda_graph_modules``; empty with a graph impl means whole layers."""
    warmup_steps: int = 1
    """Eager steps before TE graphs are captured (TE's own capture then warms each layer up to 10 times)."""

    def __post_init__(self) -> None:
        _positive("cuda_graph.warmup_steps", self.warmup_steps, allow_zero=True)


@dataclass(kw_only=True)
class DispatcherConf:
    name: str = "alltoall"
    token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall
    """megatron-core ``moe_token_dispatcher_type``: allgather | alltoall | flex."""
    flex_backend: FlexBackend | None = None
    """``deepep`` or ``hybridep`` with the flex dispatcher."""
    capacity_factor: float | None = None
    pad_to_capacity: bool = False

    def __post_init__(self) -> None:
        _positive("dispatcher.capacity_factor", self.capacity_factor)


@dataclass(kw_only=True)
class VisionTrainingConf:
    name: str = "trainable"
    freeze_encoder: bool = False
    freeze_projector: bool = False


@dataclass(kw_only=True)
class FusionsConf:
    """megatron-core's kernel fusions; None means on for GPU hardware, off on the CPU (they need CUDA).

    Six exceptions, where None means off. ``bias_dropout`` and ``cross_entropy``: megatron-core builds them with
    ``torch.compile`` (``megatron.core.jit.jit_fuser``), which compiles in every new process, so in every trial:
    on an H100 (3D, MBS 32) the first warm-up step took 44 s with ``fusions=on`` and empty compile caches, 19 s
    with the previous run's caches, 2.2 s with ``fusions=off``, at step times within the runs' noise; and the fused
    loss holds an fp32 copy of the logits (``plan/memory.py``). The other fusions are Transformer Engine kernels,
    built with TE, that cost nothing to start, with one to watch: ``moe_permute`` runs TE's permutation as Triton
    kernels (``transformer_engine/pytorch/triton/permutation.py``), compiled and autotuned in each new process; on
    the H100 with the compile caches of earlier trials its first warm-up step was within 0.2 s of the same trial's
    without it (``benchmarks/results/h100_trial_cost/moe_permute.json``), so it stays on.
    ``benchmarks/trial_cost.py``'s GPU run measures each fusion this default turns on alone (first-step cost
    against step time, its summary's ``fusions``); one that does not pay for itself within a trial joins the list
    below. ``gradient_accumulation``: a layer's weight-gradient GEMM accumulates into DDP's fp32 ``main_grad``
    itself. megatron's one flag needs APEX's ``fused_weight_gradient_mlp_cuda`` for megatron's own layers (the
    output layer, ColumnParallelLinear), which TE-only installs lack; there, TE's layers alone fuse it
    (``model/wgrad_fusion.py``) and the output layer accumulates unfused; with no TE layer, or under Megatron-FSDP,
    the worker's preflight rejects it and says why. On the H100's best config it ran 1.1% faster at the same memory
    and ``verify`` holds it to the unfused run (``benchmarks/results/README.md``, "Transformer Engine's
    weight-gradient fusion without APEX"). Off by default: without APEX, Megatron-FSDP (the GPUs' default layout)
    rejects it.
    ``bias_activation`` (megatron's ``bias_activation_fusion``: one kernel for
    SwiGLU, weighted by the router's probabilities in the experts, where unfused megatron runs four and saves
    three more tensors of the expert width per routed token) is measured on the H200 only as a memory saver
    (with the unfused loss it lets MBS 96 fit: ``benchmarks/results/h200_small_fused/``), not alone for speed, so
    it is not a default; ``benchmarks/gpu_steps.sh``'s ``fusions`` step measures it. ``moe_router`` (megatron's
    ``moe_router_fusion``: TE's fused top-k with its score function and the aux-loss statistics, where unfused
    megatron runs a dozen small kernels per MoE layer) is not yet measured on the H200 either.
    ``linear_cross_entropy`` is the project's own fusion (``model/linear_cross_entropy.py``): the output layer and
    the loss computed a chunk of tokens at a time, so the whole logits and their fp32 copy never exist; it replaces
    megatron's loss, so ``cross_entropy`` under ``auto`` resolves off beside it. Off unless set, like the others
    whose effect is measured in ``benchmarks/results/``."""

    name: str = "auto"
    bias_dropout: bool | None = None
    rope: bool | None = None
    masked_softmax: bool | None = None
    moe_permute: bool | None = None
    cross_entropy: bool | None = None
    gradient_accumulation: bool | None = None
    bias_activation: bool | None = None
    moe_router: bool | None = None
    linear_cross_entropy: bool | None = None

    FIELDS = (
        "bias_dropout",
        "rope",
        "masked_softmax",
        "moe_permute",
        "cross_entropy",
        "gradient_accumulation",
        "bias_activation",
        "moe_router",
        "linear_cross_entropy",
    )
    OFF_UNLESS_SET = (
        "bias_dropout",
        "cross_entropy",
        "gradient_accumulation",
        "bias_activation",
        "moe_router",
        "linear_cross_entropy",
    )
    GPU_ONLY = tuple(name for name in FIELDS if name != "linear_cross_entropy")  # plain torch: runs on the CPU

    def resolved(self, *, on_gpu: bool) -> dict[str, bool]:
        auto = {name: on_gpu and name not in self.OFF_UNLESS_SET for name in self.FIELDS}
        if self.linear_cross_entropy:
            auto["cross_entropy"] = False
        return {name: auto[name] if getattr(self, name) is None else getattr(self, name) for name in self.FIELDS}


@dataclass(kw_only=True)
class DataConf:
    name: DataSource = DataSource.synthetic_images
    realism: Realism = Realism.synthetic_images
    """How close to real multimodal input this data is; runs of different realism are never ranked together."""
    min_text_fraction: float = 0.5
    """Each sample's real text length is drawn from [min_text_fraction, 1] * model.text_tokens; the rest is
    padding, so padding is real."""
    fixed_batch: bool = False
    """Repeat one batch every step (to check that the model learns)."""
    packing: bool = False
    """Run each micro-batch's samples back to back in one row, without padding, split per sample by attention
    (TE's THD format; megatron's local attention, a block-causal mask over the row): the same samples, so realism
    is unchanged, and the decoder computes on real tokens only."""
    seed: int = 0
    loader_workers: int | None = None
    """DataLoader worker processes that build the next steps' micro-batches while the current step trains
    (``data/prefetch.py``), as a real training loop keeps its GPU fed; 0: the trainer builds each step's batches
    itself, between steps. None: 1 on a GPU, 0 on the CPU, where a worker would take a core from the ranks being
    measured. The step time never includes the fetch either way; the trial's wall does."""
    shards: str | None = None
    """``data.name=webdataset`` only: the ``.tar`` shards, as a brace pattern (``/d/cc3m-{000000..000099}.tar``),
    a glob or one path; each holds ``<key>.jpg|png`` + ``<key>.txt`` caption records (img2dataset's layout).
    Checked when the worker opens them (they live on the training machine, not where the config is composed)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.min_text_fraction <= 1.0:
            raise ConfigFieldError(f"data.min_text_fraction={self.min_text_fraction} must be in (0, 1]")
        _positive("data.loader_workers", self.loader_workers, allow_zero=True)
        if self.name == DataSource.webdataset and (self.loader_workers or 0) > 1:
            raise ConfigFieldError(
                f"data.loader_workers={self.loader_workers} with data.name=webdataset must be 0 or 1: the shard "
                "reader is one stream, and each worker would read it from its start"
            )

    def workers_on(self, device: str) -> int:
        """The DataLoader worker processes a run on ``device`` uses (``loader_workers``, or its default)."""
        if self.loader_workers is not None:
            return self.loader_workers
        return 0 if device == Device.cpu else 1


MIN_TEXT_IDS = 2
"""Text ids every sample carries after its image placeholders: one real label needs an id to predict it from."""


def row_layout(model: ModelConf, data: DataConf) -> tuple[int, int]:
    """(image placeholders, ids) of each row ``data.name`` lays out: ``model.text_tokens`` ids after the model's
    images, or, for mock_text, the multimodal run's whole decoder sequence as text and no images."""
    if data.name == "mock_text":
        return 0, model.seq_length
    return model.images_per_sample, model.text_tokens


def shortest_decoder_sample(model: ModelConf, data: DataConf) -> int:
    """The fewest real decoder tokens one sample of ``data`` can have, so a packed micro-batch holds at least
    ``mbs`` times this. Synthetic rows draw at least ``min_text_fraction`` of their row; a real caption can be as
    short as ``MIN_TEXT_IDS``."""
    images, row = row_layout(model, data)
    shortest = images + MIN_TEXT_IDS
    ids = shortest if data.name == "webdataset" else min(row, max(round(data.min_text_fraction * row), shortest))
    return ids + images * (model.image_tokens - 1)


@dataclass(kw_only=True)
class HardwareConf:
    name: str = "cpu"
    device: Device = Device.cpu
    peak_bf16_tflops: float | None = None
    """Dense bf16 peak per GPU (datasheet); None on the CPU, where a matmul peak is measured at start."""
    memory_gib: float = 16.0
    gpus_per_node: int = 4
    """On the CPU: the most worker processes one node runs."""
    fp8: bool = False
    """The GPU runs FP8 GEMMs (Hopper and later: Transformer Engine's ``check_fp8_support`` wants compute
    capability 9.0, or 8.9 with CUDA 12.1); ``train.precision=fp8`` is rejected where false."""

    def __post_init__(self) -> None:
        _positive("hardware.peak_bf16_tflops", self.peak_bf16_tflops)
        _positive("hardware.memory_gib", self.memory_gib)
        _positive("hardware.gpus_per_node", self.gpus_per_node)
        if self.device == "cuda" and self.peak_bf16_tflops is None:
            raise ConfigFieldError(f"hardware.peak_bf16_tflops must be set for GPU hardware {self.name!r}")


@dataclass(kw_only=True)
class LauncherConf:
    name: Launcher = Launcher.local
    nproc_per_node: int = 1
    nnodes: int = 1

    def __post_init__(self) -> None:
        _positive("launcher.nproc_per_node", self.nproc_per_node)
        _positive("launcher.nnodes", self.nnodes)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


@dataclass(kw_only=True)
class TrackingConf:
    name: str = "none"
    backend: TrackingBackend = TrackingBackend.none
    tracking_uri: str | None = None
    """None: SQLite under the outputs folder."""
    experiment: str = "moe-vlm-sweep"


@dataclass(kw_only=True)
class TrainConf:
    warmup_steps: int = 2
    steps: int = 8
    """Measured steps; with ``target_cv``, the most a run measures (``train/steps.py``)."""
    target_cv: float | None = None
    """Stop measuring once the step times' CV is at or below this (e.g. 0.02), after ``min_steps``; None: measure
    exactly ``steps``."""
    min_steps: int = 4
    """The fewest measured steps before ``target_cv`` may stop measuring (at least 2: one step has no spread)."""
    profile_steps: int = 1
    """Extra steps after the timed ones, with per-component timing (synchronizing) hooks on."""
    trace: bool = False
    """Run torch.profiler over the profile steps: ``trace.json`` (Chrome trace) and ``kernels.txt`` (top ops by
    device time) in the run directory, to see whether the GPU idles (launch-bound) or computes."""
    trace_first_step: bool = False
    """Run torch.profiler over the run's first step alone: ``train.trace``'s files under the ``first_step_``
    prefix (``first_step_trace.json``, ``first_step_host_ops.txt``, ...). The first step pays what no later step
    repeats (CUDA kernel modules loaded at their first launch, cuDNN attention plans built per shape, autotuning,
    the allocator's growth); this says which, inside a trial's warm-up. The profiler's own overhead lands in that
    step's time."""
    manual_gc: bool = True
    """Collect Python's garbage once after the warmup steps, then keep the collector off until the run ends (as
    Megatron-LM's ``--manual-gc``), so no collection pause lands inside a timed step of a host-bound loop.
    ``metrics.json``'s ``gc_in_measured_steps`` says what the collector did inside them."""
    expandable_segments: bool = False
    """PyTorch's caching allocator grows its segments in place instead of carving new blocks
    (``expandable_segments:True`` in PyTorch's allocator settings, set by the launcher for the worker), so
    shapes that change every micro-batch (packed rows) and large transients (the loss's logits) leave no stranded
    memory: the padded MBS 112 run on the H200 ran out of memory with 18.8 GiB reserved but unallocated
    (``benchmarks/results/h200_small_fused/h200_mbs96_repeats.json``). GPU only."""
    activation_census: bool = True
    """One untimed step (the last warm-up step, or one after the measured steps with fewer than two warm-up steps:
    ``train/loop.py: Trainer.schedule``) counts the tensors autograd saves for backward, per part of the model
    (``train/census.py``): ``metrics.json``'s ``saved_activations``, next to the memory estimate's parts. Not with
    CUDA graphs, whose replayed layers save out of the hooks' sight."""
    timeout_s: float = 600.0
    seed: int = 1234
    lr: float = 1e-3
    precision: Precision = Precision.auto
    """``auto``: bf16 on GPU, fp32 on the CPU. ``fp8``: bf16 parameters and activations, with the decoder's
    Transformer Engine GEMMs in FP8 (megatron-core's ``fp8="hybrid"``: E4M3 forward, E5M2 gradients) under
    ``fp8_recipe``; the vision encoder, the projector, the embedding, the output layer and the router stay bf16.
    It changes the numerics, so it is a recipe field (``config/recipe.py``)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.delayed
    """With ``precision=fp8``: Transformer Engine's scaling recipe as megatron-core names it
    (``TransformerConfig.fp8_recipe``): ``delayed`` (one scale per tensor from past steps' amax), ``tensorwise``
    (per-tensor current scaling, ``Float8CurrentScaling``) or ``blockwise`` (1x128 / 128x128 block scales,
    ``Float8BlockScaling``, CUDA 12.9+). Hopper's recipes only: ``mxfp8`` needs Blackwell."""
    transformer_impl: TransformerImpl = TransformerImpl.auto
    """``auto``: Transformer Engine specs on GPU, local specs on the CPU."""

    def __post_init__(self) -> None:
        _positive("train.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("train.steps", self.steps)
        if self.min_steps < 2:
            raise ConfigFieldError(f"train.min_steps={self.min_steps} must be >= 2 (one step's times have no spread)")
        if self.target_cv is not None and not 0 < self.target_cv < 1:
            raise ConfigFieldError(f"train.target_cv={self.target_cv} must be > 0 and < 1 (or null: fixed steps)")
        _positive("train.profile_steps", self.profile_steps, allow_zero=True)
        _positive("train.timeout_s", self.timeout_s)
        _positive("train.lr", self.lr)

    def resolved_precision(self, device: str) -> str:
        """The dtype parameters and activations are kept in: ``fp8`` runs keep them in bf16 (``fp8_in_use``
        says which FP8 recipe the decoder's GEMMs run)."""
        if self.precision == "fp8":
            return "bf16"
        if self.precision != "auto":
            return self.precision
        return "bf16" if device == "cuda" else "fp32"

    @property
    def fp8_in_use(self) -> str | None:
        """The FP8 recipe of the decoder's GEMMs, or None for a run without FP8."""
        return self.fp8_recipe if self.precision == "fp8" else None

    def resolved_transformer_impl(self, device: str) -> str:
        if self.transformer_impl != "auto":
            return self.transformer_impl
        return "transformer_engine" if device == "cuda" else "local"


@dataclass(kw_only=True)
class RunConfig:
    """Everything one training run needs; composed by Hydra from ``conf/config.yaml``."""

    model: ModelConf = field(default_factory=ModelConf)
    parallel: ParallelConf = field(default_factory=ParallelConf)
    batch: BatchConf = field(default_factory=BatchConf)
    recompute: RecomputeConf = field(default_factory=RecomputeConf)
    cuda_graph: CudaGraphConf = field(default_factory=CudaGraphConf)
    dispatcher: DispatcherConf = field(default_factory=DispatcherConf)
    vision: VisionTrainingConf = field(default_factory=VisionTrainingConf)
    fusions: FusionsConf = field(default_factory=FusionsConf)
    data: DataConf = field(default_factory=DataConf)
    hardware: HardwareConf = field(default_factory=HardwareConf)
    launcher: LauncherConf = field(default_factory=LauncherConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    train: TrainConf = field(default_factory=TrainConf)
    outputs_dir: str = "outputs"


def from_dict(cls: type, data: dict[str, Any]) -> Any:
    """Rebuild a (nested) config dataclass from plain data, running every ``__post_init__`` again."""
    return codec.from_dict(cls, data, error=ConfigFieldError)


to_dict = codec.to_dict
