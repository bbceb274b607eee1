"""Peak GPU memory of one rank, estimated before launch, so a sweep never spends a GPU on a config that cannot fit.

The estimate is a lower bound by design: it counts what a run must hold and leaves out what it may add
(allocator fragmentation, cuBLAS/cuDNN workspaces, NCCL buffers, CUDA-graph pools, temporary copies). A config
is refused only when even the lower bound exceeds the GPU, so the check never rejects a config that fits; the
rest is caught as ``oom`` at run time. ``tests/test_memory.py`` holds it against every peak measured on the
H200 (``benchmarks/results/``): never above a measurement, and close to it.

Static memory per rank (megatron-core, bf16, distributed optimizer):
  weights 2 B/param (bf16), main gradients 4 B/param (``grad_reduce_in_fp32``), optimizer 12 B/param (fp32
  master copy, Adam's two moments) sharded over data parallelism. Dense parameters are split by TP and PP, expert
  parameters by EP x ETP and PP; Megatron-FSDP shards gradients (``optim_grads``) and weights
  (``optim_grads_params``) over data parallelism too. The rank holding the most is counted: the first pipeline
  stage (embedding, vision encoder, projector) or the last (output layer).

Activations per micro-batch, saved for backward (bytes per token per layer, bf16, flash attention: no s x s
term), after Korthikanti et al. 2022 adapted to GQA, SwiGLU experts and top-k routing; divided by TP under
sequence parallelism and by CP; ``recompute=full`` keeps only each layer's input; frozen modules save none. The
first pipeline stage holds up to ``pp`` micro-batches in flight (1F1B). Every eager run measures these parts
(``train/census.py``: ``metrics.json``'s ``saved_activations``), the evidence for what the formula leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_vlm_sweep.config.schema import DecoderConf, ModelConf, RunConfig
from moe_vlm_sweep.plan.layout import layout_of, sharded_seq_length

GIB = 2**30
WEIGHT_BYTES = 2
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
        embedding=d.vocab_size * h, output_layer=d.vocab_size * h + h,
        decoder_dense=d.num_layers * attention + d.num_moe_layers * (h * d.num_experts + shared)
        + dense_layers * 3 * h * d.ffn_hidden_size,
        experts=d.num_moe_layers * d.num_experts * 3 * h * d.moe_ffn_hidden_size,
        vision=v.num_layers * vision_layer + 3 * v.patch_size**2 * v.hidden_size
        + (v.patches_per_image + v.class_token_len) * v.hidden_size,
        projector=projector,
    )


def _decoder_layer_bytes_per_token(d: DecoderConf, *, moe: bool, element_bytes: int) -> float:
    """Saved activations of one decoder layer per token (``element_bytes`` 2: bf16 on the GPU)."""
    h, q, kv = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_query_groups * d.head_dim
    # input norm in, QKV in, Q K V, attention out (proj in); softmax statistics are fp32, one per head
    attention = element_bytes * (h + h + q + 2 * kv + q) + 4 * d.num_attention_heads
    if not moe:
        return attention + element_bytes * (h + h + 2 * d.ffn_hidden_size + d.ffn_hidden_size)
    k, f = d.moe_router_topk, d.moe_ffn_hidden_size
    shared = d.moe_shared_expert_intermediate_size or 0
    # norm in, router in, routed copies in (k x h), fc1 out (k x 2f, for SwiGLU's backward), fc2 in (k x f),
    # fc2 out (k x h, for the weighted unpermute), shared experts like a dense SwiGLU MLP
    return attention + element_bytes * ((h + h + k * h + k * 2 * f + k * f + k * h)
                                        + (2 * shared + shared if shared else 0))


ACTIVATION_PARTS = ("vision_encoder", "decoder.layers", "decoder.output")
"""The parts the activation estimate adds up; ``train/census.py`` measures the same parts (and finer ones)."""


def activation_parts(cfg: RunConfig, seq_length: int, element_bytes: int = WEIGHT_BYTES) -> dict[str, float]:
    """Bytes saved for backward by one micro-batch on the first pipeline stage (the one with the most), per part
    of ``ACTIVATION_PARTS``. ``element_bytes`` is 2 (bf16) on the GPU; the loss input is fp32 either way."""
    m, d, p, rc = cfg.model, cfg.model.decoder, cfg.parallel, cfg.recompute
    tokens = cfg.batch.mbs * seq_length / p.cp / (p.tp if p.sp else 1)
    layers = d.num_layers / p.pp
    moe_share = d.num_moe_layers / d.num_layers
    per_layer = (moe_share * _decoder_layer_bytes_per_token(d, moe=True, element_bytes=element_bytes)
                 + (1 - moe_share) * _decoder_layer_bytes_per_token(d, moe=False, element_bytes=element_bytes))
    if rc.granularity == "full":  # each layer's input, plus one layer recomputed at a time
        decoder = tokens * (layers * element_bytes * d.hidden_size + per_layer)
    else:
        decoder = tokens * layers * per_layer
    logits = tokens * d.vocab_size * 4 / (p.tp if not p.sp else 1) if p.pp == 1 else 0.0  # fp32 loss input
    v = m.vision
    vision_tokens = cfg.batch.mbs * m.images_per_sample * (v.patches_per_image + v.class_token_len)
    vision = 0.0 if cfg.vision.freeze_encoder else vision_tokens * v.num_layers * element_bytes * (
        6 * v.hidden_size + 2 * v.ffn_hidden_size)
    return {"vision_encoder": vision, "decoder.layers": decoder, "decoder.output": logits}


def activation_bytes(cfg: RunConfig, seq_length: int) -> float:
    """Saved activations of one micro-batch on the first pipeline stage (the one with the most), bf16."""
    return sum(activation_parts(cfg, seq_length).values())


def static_bytes(cfg: RunConfig, dp: int, edp: int) -> float:
    """Weights, main gradients and optimizer states on the rank that holds the most."""
    p, n = cfg.parallel, parameter_counts(cfg.model)
    body = n.decoder_dense / (p.tp * p.pp)
    first = body + (n.embedding + n.vision + n.projector) / p.tp
    last = body + n.output_layer / p.tp
    dense = max(first, last) if p.pp > 1 else body + (n.embedding + n.output_layer + n.vision + n.projector) / p.tp
    experts = n.experts / (p.ep * p.etp * p.pp)
    fsdp = p.strategy == "fsdp"
    shard_weights = fsdp and p.fsdp_sharding == "optim_grads_params"
    shard_grads = fsdp and p.fsdp_sharding in ("optim_grads", "optim_grads_params")

    def per_rank(count: float, replicas: int) -> float:
        return count * (WEIGHT_BYTES / (replicas if shard_weights else 1)
                        + GRAD_BYTES / (replicas if shard_grads else 1) + OPTIMIZER_BYTES / replicas)

    return per_rank(dense, dp) + per_rank(experts, edp)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    static_gib: float
    activations_gib: float
    """Per micro-batch, times the micro-batches in flight on the first stage."""

    @property
    def total_gib(self) -> float:
        return self.static_gib + self.activations_gib


def estimate(cfg: RunConfig) -> MemoryEstimate:
    """The lower-bound peak of the most loaded rank (see the module docstring for what it counts)."""
    layout = layout_of(cfg)
    return MemoryEstimate(static_gib=static_bytes(cfg, layout.dp, layout.edp) / GIB,
                          activations_gib=microbatches_in_flight(cfg) * activation_bytes(cfg, sharded_seq_length(cfg))
                          / GIB)


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
