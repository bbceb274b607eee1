"""Peak GPU memory of one rank, estimated before launch, so a sweep never spends a GPU on a config that cannot fit.

The estimate is a lower bound by design: it counts what a run must hold and leaves out what it may add
(allocator fragmentation, cuBLAS/cuDNN workspaces, NCCL buffers, CUDA-graph pools, most temporaries). A config
is refused only when even the lower bound exceeds the GPU, so the check never rejects a config that fits; the
rest is caught as ``oom`` at run time. ``tests/test_memory.py`` holds it against every peak measured on the
H200 (``benchmarks/results/``): never above a measurement, and close to it.

Static memory per rank (megatron-core, bf16, distributed optimizer):
  weights 2 B/param (bf16), main gradients 4 B/param (``grad_reduce_in_fp32``), optimizer 12 B/param (fp32
  master copy, Adam's two moments) sharded over data parallelism. Dense parameters are split by TP and PP, expert
  parameters by EP x ETP and PP; Megatron-FSDP shards gradients (``optim_grads``) and weights
  (``optim_grads_params``) over data parallelism too. The rank holding the most is counted: the first pipeline
  stage (embedding, vision encoder, projector) or the last (output layer). Frozen modules hold weights only.
  ``train.precision=fp8`` adds TE's FP8 copies of the decoder's GEMM weights (:data:`FP8_WEIGHT_BYTES`) and
  counts the decoder layers' saved activations at one byte an element (:data:`FP8_ELEMENT_BYTES`; under full
  recompute the layers keep their bf16 inputs only).

Activations per micro-batch, saved for backward (bytes per token per layer, bf16, flash attention: no s x s
term), after Korthikanti et al. 2022 adapted to GQA, SwiGLU experts and top-k routing, and then to what
megatron-core 0.19 with TE actually saves, source line by source line (the census of the H200 sweep:
``benchmarks/results/h200_small_s1664/``); divided by TP under sequence parallelism and by CP; selective
recompute frees its modules' share, ``recompute=full`` keeps only each layer's input; frozen modules save none.
A packed micro-batch (``data.packing``) counts the fewest real tokens its samples can have. The first
pipeline stage holds up to ``pp`` micro-batches in flight (1F1B). At the peak, the loss's logits or a
recomputed layer come on top (``transient_bytes``). Every eager run measures the saved parts
(``train/census.py``: ``metrics.json``'s ``saved_activations``), the evidence ``tests/test_memory.py`` holds the
formula to.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_vlm_sweep.config.schema import DecoderConf, ModelConf, RunConfig, shortest_decoder_sample
from moe_vlm_sweep.plan.layout import layout_of, sharded_seq_length

GIB = 2**30
ELEMENT_BYTES = {"bf16": 2, "fp32": 4}
"""Bytes of an activation element by the run's precision (``train.precision`` resolved: ``plan.precision``)."""
WEIGHT_BYTES = ELEMENT_BYTES["bf16"]
GRAD_BYTES = 4
OPTIMIZER_BYTES = 12


@dataclass(frozen=True, kw_only=True)
class Params:
    """Parameter counts of the model's parts (whole model, unsharded)."""

    embedding: int
    output_layer: int
    decoder_dense: int
    """Attention, norms, routers and dense MLPs of all decoder layers."""
    experts: int
    """Routed experts of all MoE layers."""
    vision: int
    projector: int


def parameter_counts(model: ModelConf) -> Params:
    d, v = model.decoder, model.vision
    h, hd = d.hidden_size, d.head_dim
    attention = h * (d.num_attention_heads + 2 * d.num_query_groups) * hd + d.num_attention_heads * hd * h + 2 * h
    shared = 3 * h * (d.moe_shared_expert_intermediate_size or 0)
    dense_layers = d.num_layers - d.num_moe_layers
    vision_layer = 4 * v.hidden_size**2 + 2 * v.hidden_size * v.ffn_hidden_size + 9 * v.hidden_size  # + biases, norms
    width_in = v.hidden_size * v.spatial_merge**2
    ffn = model.projector.ffn_hidden_size or h
    projector = width_in * h if model.projector.kind == "affine" else width_in * ffn + ffn * h
    return Params(
        embedding=d.vocab_size * h,
        output_layer=d.vocab_size * h + h,
        decoder_dense=d.num_layers * attention
        + d.num_moe_layers * (h * d.num_experts + shared)
        + dense_layers * 3 * h * d.ffn_hidden_size,
        experts=d.num_moe_layers * d.num_experts * 3 * h * d.moe_ffn_hidden_size,
        vision=v.num_layers * vision_layer
        + 3 * v.patch_size**2 * v.hidden_size
        + (v.patches_per_image + v.class_token_len) * v.hidden_size,
        projector=projector,
    )


def _decoder_layer_bytes_per_token(
    d: DecoderConf,
    *,
    moe: bool,
    element_bytes: int,
    recomputed: frozenset[str] = frozenset(),
    fused_swiglu: bool = False,
) -> float:
    """Saved activations of one decoder layer per token, as the census counts them on the H200 (megatron-core
    0.19, TE; ``benchmarks/results/h200_small_s1664/memory.json``); ``recomputed``: selective recompute modules.

    Every SwiGLU keeps five widths of its hidden size: fc1's output (two), silu's output, the copy that
    ``x_linear + glu_linear_offset`` makes, and the product (fc2's input; for experts the product is weighted by
    the router's probabilities first, a sixth); fused (``fusions.bias_activation``), three: fc1's output and the
    kernel's. ``moe_act`` recompute keeps only fc1's output, ``moe`` only the layer's input, ``layernorm`` frees a
    norm's output; ``core_attn`` frees only the softmax statistics with fused attention (its checkpoint keeps the
    whole QKV output alive, more than it frees)."""
    h, q, kv, e = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_query_groups * d.head_dim, element_bytes
    norm_out = 0 if "layernorm" in recomputed else h
    # input norm in and out (QKV in), Q K V, attention out (proj in); softmax statistics are fp32, one per head
    attention = e * (h + norm_out + q + 2 * kv + q) + (0 if "core_attn" in recomputed else 4 * d.num_attention_heads)
    glu, expert_glu = (3, 3) if fused_swiglu else (5, 6)
    if not moe:
        mlp = 0 if "mlp" in recomputed else glu * d.ffn_hidden_size
        return attention + e * (h + norm_out + mlp)
    if "moe" in recomputed:  # the pre-MLP norm's input, and the checkpoint's: the norm's output
        return attention + e * 2 * h
    k, f, shared = d.moe_router_topk, d.moe_ffn_hidden_size, d.moe_shared_expert_intermediate_size or 0
    experts = k * h + (2 if "moe_act" in recomputed else expert_glu) * k * f  # fc1 in (the routed copies), after
    return attention + e * (h + norm_out + experts + (0 if "shared_experts" in recomputed else glu * shared))


ACTIVATION_PARTS = ("vision_encoder", "projector", "decoder.layers", "decoder.output")
"""The parts the activation estimate adds up; ``train/census.py`` measures the same parts (and finer ones)."""


def activation_parts(cfg: RunConfig, seq_length: int, element_bytes: int = WEIGHT_BYTES) -> dict[str, float]:
    """Bytes saved for backward by one micro-batch on the first pipeline stage (the one with the most), per part
    of ``ACTIVATION_PARTS``: what the census counts. ``element_bytes`` is 2 (bf16) on the GPU; the loss input is
    fp32 either way. Under full recompute the layers keep only their inputs (``transient_bytes`` adds the layer
    being recomputed)."""
    m, d, p, rc = cfg.model, cfg.model.decoder, cfg.parallel, cfg.recompute
    tokens = _decoder_tokens(cfg, seq_length)
    layers = d.num_layers / p.pp
    if rc.granularity == "full":  # the layers' inputs, bf16 under FP8 too
        decoder = tokens * layers * element_bytes * d.hidden_size
    else:
        layer_bytes = FP8_ELEMENT_BYTES if cfg.train.precision == "fp8" else element_bytes
        moe_share = d.num_moe_layers / d.num_layers
        decoder = (
            tokens
            * layers
            * sum(
                share
                * _decoder_layer_bytes_per_token(
                    d,
                    moe=moe,
                    element_bytes=layer_bytes,
                    recomputed=frozenset(rc.modules),  # selective only (rules.py)
                    fused_swiglu=_fused(cfg, "bias_activation"),
                )
                for moe, share in ((True, moe_share), (False, 1 - moe_share))
            )
        )
    v, pr = m.vision, m.projector
    images = cfg.batch.mbs * m.images_per_sample
    # Vision and projector run the decoder's TP without SP: norms whole, the rest split by TP. Per layer: both
    # norms' inputs and outputs; Q K V and attention out; the MLP's hidden twice (GELU in and out).
    vision = (
        0.0
        if cfg.vision.freeze_encoder
        else images
        * (v.patches_per_image + v.class_token_len)
        * (v.num_layers * element_bytes * (4 * v.hidden_size + (4 * v.hidden_size + 2 * v.ffn_hidden_size) / p.tp))
    )
    # the merged patches in (whole), the hidden twice (GELU in and out)
    hidden = 2 * (pr.ffn_hidden_size or d.hidden_size) / p.tp if pr.kind == "mlp" else 0
    projector = (
        0.0
        if cfg.vision.freeze_projector
        else images
        * v.patches_per_image
        / v.spatial_merge**2
        * (element_bytes * (v.hidden_size * v.spatial_merge**2 + hidden))
    )
    return {
        "vision_encoder": vision,
        "projector": projector,
        "decoder.layers": decoder,
        "decoder.output": _output_bytes(cfg, tokens, element_bytes),
    }


FP8_ELEMENT_BYTES = 1
"""``train.precision=fp8``: bytes the estimate counts per element the decoder's layers save for backward. TE saves
its FP8 GEMMs' inputs in FP8 and the rest (norm inputs, attention, the activation function's input) in bf16; which
is which is not modelled per layer, so every element counts one byte: a lower bound whatever the split (counted
as bf16, they could put the estimate above the peak that the FP8 weight copies already raise)."""


LINEAR_CE_CHUNK_BYTES = 2**29
"""The fp32 logits of one chunk of the fused linear cross-entropy (``fusions.linear_cross_entropy``): large
enough that each chunk's GEMMs stay efficient, small next to the whole logits it replaces."""


def linear_ce_chunk_tokens(vocab_shard: int) -> int:
    """Tokens per chunk of the fused linear cross-entropy, for a vocabulary shard of ``vocab_shard`` entries."""
    return max(1, LINEAR_CE_CHUNK_BYTES // (4 * vocab_shard))


def _output_bytes(cfg: RunConfig, tokens: float, element_bytes: int) -> float:
    """The output layer's input and what the loss keeps for backward, on the last pipeline stage only: the fp32
    logits, or under the fused linear cross-entropy one fp32 log-sum-exp per token."""
    if cfg.parallel.pp > 1:
        return 0.0
    kept = 4 * tokens if _fused(cfg, "linear_cross_entropy") else 4 * _logits(cfg, tokens)
    return tokens * element_bytes * cfg.model.decoder.hidden_size + kept


def _logits(cfg: RunConfig, tokens: float) -> float:
    """Logits of one micro-batch on one rank: vocab-parallel over TP, the whole sequence (SP gathers it); on the
    last pipeline stage only, so none on the first stage that the estimate counts when PP > 1."""
    p = cfg.parallel
    return tokens * cfg.model.decoder.vocab_size / (p.tp if not p.sp else 1) if p.pp == 1 else 0.0


def transient_bytes(cfg: RunConfig, seq_length: int, element_bytes: int = WEIGHT_BYTES) -> float:
    """What the peak holds on top of the saved activations, at its moment: at the loss, the logits in the model's
    precision, and with fused cross-entropy an fp32 working copy next to them (the H200's MBS 96 trials failed
    allocating exactly that, 19.5 GiB; with the fusion off the peak is that much lower); under full recompute, one
    layer's activations rebuilt during backward, by when the loss has freed its logits. The larger of the two.
    Left out under CUDA graphs, whose runs peak 4-6 GiB below eager at MBS 32-64 (``h200_scopes_s1664/``) for
    reasons the census cannot see (it does not run under graphs), so that the bound holds there too."""
    if cfg.cuda_graph.impl != "none":
        return 0.0
    d, tokens = cfg.model.decoder, _decoder_tokens(cfg, seq_length)
    if _fused(cfg, "linear_cross_entropy"):
        loss = _linear_ce_transient(cfg, tokens, element_bytes)
    else:
        loss = _logits(cfg, tokens) * (element_bytes + 4 * _fused(cfg, "cross_entropy"))
    layer = 0.0
    if cfg.recompute.granularity == "full":
        kinds = [moe for moe, count in ((True, d.num_moe_layers), (False, d.num_layers - d.num_moe_layers)) if count]
        layer = tokens * max(
            _decoder_layer_bytes_per_token(
                d, moe=moe, element_bytes=element_bytes, fused_swiglu=_fused(cfg, "bias_activation")
            )
            for moe in kinds
        ) - _output_bytes(cfg, tokens, element_bytes)
    return max(loss, layer)


def _linear_ce_transient(cfg: RunConfig, tokens: float, element_bytes: int) -> float:
    """The fused linear cross-entropy's backward at its peak: one chunk's fp32 probabilities and their cast, the
    fp32 weight-gradient accumulator and the hidden states' gradient (``model/linear_cross_entropy.py``)."""
    p, d = cfg.parallel, cfg.model.decoder
    if p.pp > 1:
        return 0.0
    shard = d.vocab_size / p.tp
    chunk = min(tokens * (p.tp if p.sp else 1), linear_ce_chunk_tokens(int(shard)))
    return chunk * shard * (4 + element_bytes) + 4 * shard * d.hidden_size + tokens * element_bytes * d.hidden_size


def _fused(cfg: RunConfig, fusion: str) -> bool:
    return cfg.fusions.resolved(on_gpu=cfg.hardware.device == "cuda")[fusion]


def _decoder_tokens(cfg: RunConfig, seq_length: int) -> float:
    """Decoder tokens of one micro-batch on one rank: split by CP, and by TP under sequence parallelism. Packed
    (``data.packing``), a micro-batch is its samples' real tokens, at least ``mbs`` of the data's shortest."""
    p = cfg.parallel
    per_sample = shortest_decoder_sample(cfg.model, cfg.data) if cfg.data.packing else seq_length
    return cfg.batch.mbs * per_sample / p.cp / (p.tp if p.sp else 1)


def static_bytes(cfg: RunConfig, dp: int, edp: int) -> float:
    """Weights, main gradients and optimizer states on the rank that holds the most; frozen modules (vision)
    hold weights only. Under Megatron-FSDP's ``optim_grads_params`` the bf16 weights of what it trains are left
    out: at DP 1 it peaks 1.4 GiB below 3D (``h200_small_knobs.json``), the size of model=small's bf16 weights
    (were it bf16 gradients instead, the estimate stays a bound)."""
    p, n, v = cfg.parallel, parameter_counts(cfg.model), cfg.vision
    frozen = (n.vision if v.freeze_encoder else 0) + (n.projector if v.freeze_projector else 0)
    body = n.decoder_dense / (p.tp * p.pp)
    vision = (n.vision + n.projector - frozen) / p.tp
    fsdp = p.strategy == "fsdp"
    shard_weights = fsdp and p.fsdp_sharding == "optim_grads_params"
    shard_grads = fsdp and p.fsdp_sharding in ("optim_grads", "optim_grads_params")

    def per_rank(count: float, replicas: int, trained: bool = True) -> float:
        if not trained:
            return count * WEIGHT_BYTES / (replicas if shard_weights else 1)
        weights = 0.0 if shard_weights else count * WEIGHT_BYTES
        return weights + count * (GRAD_BYTES / (replicas if shard_grads else 1) + OPTIMIZER_BYTES / replicas)

    first = per_rank(body + (n.embedding / p.tp + vision), dp) + per_rank(frozen / p.tp, dp, trained=False)
    last = per_rank(body + n.output_layer / p.tp, dp)
    dense = max(first, last) if p.pp > 1 else first + per_rank(n.output_layer / p.tp, dp)
    return dense + per_rank(n.experts / (p.ep * p.etp * p.pp), edp) + fp8_weight_bytes(cfg)


FP8_WEIGHT_BYTES = 2
"""``train.precision=fp8``: bytes per decoder GEMM weight that TE holds in FP8 next to the bf16 weight, the
row-wise copy its forward reads and the column-wise (transposed) one its input-gradient GEMM reads, kept between
micro-batches (megatron passes TE ``is_first_microbatch`` unless ``disable_parameter_transpose_cache``)."""


def fp8_weight_bytes(cfg: RunConfig) -> float:
    """FP8 copies of one rank's decoder GEMM weights (attention, dense MLPs, shared and routed experts; not the
    routers, which stay bf16); 0 without FP8."""
    if cfg.train.precision != "fp8":
        return 0.0
    d, p = cfg.model.decoder, cfg.parallel
    attention = d.hidden_size * d.head_dim * (2 * d.num_attention_heads + 2 * d.num_query_groups)
    dense = (d.num_layers - d.num_moe_layers) * 3 * d.hidden_size * d.ffn_hidden_size
    shared = d.num_moe_layers * 3 * d.hidden_size * (d.moe_shared_expert_intermediate_size or 0)
    body = (d.num_layers * attention + dense + shared) / (p.tp * p.pp)
    experts = parameter_counts(cfg.model).experts / (p.ep * p.etp * p.pp)
    return (body + experts) * FP8_WEIGHT_BYTES


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    static_gib: float
    activations_gib: float
    """Saved per micro-batch, times the micro-batches in flight on the first stage, plus ``transient_bytes``."""

    @property
    def total_gib(self) -> float:
        return self.static_gib + self.activations_gib


def estimate(cfg: RunConfig) -> MemoryEstimate:
    """The lower-bound peak of the most loaded rank (see the module docstring for what it counts)."""
    layout, seq = layout_of(cfg), sharded_seq_length(cfg)
    saved = microbatches_in_flight(cfg) * sum(activation_parts(cfg, seq).values())
    return MemoryEstimate(
        static_gib=static_bytes(cfg, layout.dp, layout.edp) / GIB,
        activations_gib=(saved + transient_bytes(cfg, seq)) / GIB,
    )


def microbatches_in_flight(cfg: RunConfig) -> float:
    """Micro-batches' worth of activations the first pipeline stage holds at once under 1F1B: up to ``pp``.
    Interleaved (VPP), megatron's schedule runs ``2 (pp - 1) + (vpp - 1) pp`` chunk forwards ahead of the first
    backward, each ``1 / vpp`` of the stage's layers."""
    p = cfg.parallel
    microbatches = max(1, cfg.batch.gbs // (cfg.batch.mbs * layout_of(cfg).dp))
    if p.vpp <= 1:
        return min(p.pp, microbatches)
    chunks = min(2 * (p.pp - 1) + (p.vpp - 1) * p.pp + 1, microbatches * p.vpp)
    return chunks / p.vpp
