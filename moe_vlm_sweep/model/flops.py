"""Analytic FLOPs of one optimizer step, per component (vision encoder, projector, decoder): the one place.

Counting rules (a multiply-add is 2 FLOPs; only matmuls count, elementwise work is ignored):
- Forward 1x, backward 2x (gradient w.r.t. inputs and w.r.t. weights). A frozen module has no weight
  gradients: its backward is 1x when something before it still trains (the gradient must flow through it),
  else 0 (a frozen vision encoder sees no backward at all: images need no gradient).
- Useful FLOPs (MFU) exclude recompute; hardware FLOPs (HFU) add the recomputed forwards.
- Shapes are the batch as run: padded decoder sequences (padding costs compute), every image's patches.
"""

from __future__ import annotations

from moe_vlm_sweep.config.schema import DecoderConf, ModelConf, RecomputeConf, RunConfig
from moe_vlm_sweep.metrics.schema import ComponentFlops

ACCOUNTING_NOTES = (
    "FLOPs count matmuls only (2 per multiply-add); norms, activations, softmax, RoPE and the loss are ignored.",
    "Decoder FLOPs and tokens/s use padded sequences: padding is computed, so it is counted; "
    "effective_tokens_per_s counts real tokens only, FLOPs have no real-token variant yet.",
    "Causal attention is counted as half of the score and value matmuls, although non-flash kernels "
    "(local DotProductAttention) compute the full square and mask it.",
    "MoE experts count exactly top-k per token: tokens dropped or padded by a capacity factor are not modelled.",
    "The vision encoder (CLS token included) attends without a mask over one image's tokens; it is never "
    "recomputed (recompute knobs apply to the decoder only).",
    "Per-GPU rates divide world FLOPs by world size, so pipeline bubbles and idle ranks lower MFU.",
)


def _vision_forward_per_image(model: ModelConf) -> float:
    v = model.vision
    patches = v.patches_per_image
    s = patches + (v.class_token_len if v.kind == "clip" else 0)
    h = v.hidden_size
    patch_embed = 2 * patches * 3 * v.patch_size**2 * h
    projections = 2 * s * 4 * h * h  # q, k, v, o: full multi-head attention
    scores_and_values = 2 * 2 * s * s * h  # Q K^T and A V, bidirectional (no mask)
    mlp = 2 * s * 2 * h * v.ffn_hidden_size  # GELU MLP: fc1 and fc2
    return patch_embed + v.num_layers * (projections + scores_and_values + mlp)


def _projector_forward_per_image(model: ModelConf) -> float:
    tokens = model.vision.tokens_per_image
    width_in = model.vision.hidden_size * model.vision.spatial_merge**2  # merged patches are concatenated
    out = model.decoder.hidden_size
    if model.projector.kind == "affine":
        return 2 * tokens * width_in * out
    ffn = model.projector.ffn_hidden_size or out
    return 2 * tokens * (width_in * ffn + ffn * out)


def _decoder_parts_per_sample(d: DecoderConf, seq: int) -> dict[str, float]:
    """Forward FLOPs of one sequence, split so that recompute can re-add exactly the recomputed parts."""
    h, hd = d.hidden_size, d.head_dim
    q_width, kv_width = d.num_attention_heads * hd, d.num_query_groups * hd  # GQA: fewer K/V heads
    dense_layers = d.num_layers - d.num_moe_layers
    return {
        "attn_proj": d.num_layers * 2 * seq * (h * (q_width + 2 * kv_width) + q_width * h),
        # Causal: each query sees on average half the keys, for Q K^T and for A V.
        "core_attn": d.num_layers * 2 * 2 * seq * seq * q_width * 0.5,
        "router": d.num_moe_layers * 2 * seq * h * d.num_experts,
        # SwiGLU expert: fc1 h -> 2f (gate and up), fc2 f -> h: 3 h f multiply-adds per token per expert.
        "experts": d.num_moe_layers * d.moe_router_topk * 2 * seq * 3 * h * d.moe_ffn_hidden_size,
        "shared_experts": d.num_moe_layers * 2 * seq * 3 * h * (d.moe_shared_expert_intermediate_size or 0),
        "dense_mlp": dense_layers * 2 * seq * 3 * h * d.ffn_hidden_size,
        "output_layer": 2 * seq * h * d.vocab_size,
    }


def _recomputed_forward(parts: dict[str, float], d: DecoderConf, rc: RecomputeConf, *, stages: int) -> float:
    """Decoder forward FLOPs that recompute runs a second time in the backward pass."""
    layer_total = sum(v for k, v in parts.items() if k != "output_layer")
    if rc.granularity == "full":
        if rc.method == "block" and rc.num_layers is not None:
            return layer_total * min(rc.num_layers * stages, d.num_layers) / d.num_layers
        return layer_total  # uniform: every layer is recomputed, in chunks of num_layers
    if rc.granularity == "selective":
        modules = rc.modules or ["core_attn"]
        recomputed = {"core_attn": ["core_attn"], "moe": ["router", "experts", "shared_experts"],
                      "mlp": ["dense_mlp"], "shared_experts": ["shared_experts"]}
        # moe_act and layernorm recompute elementwise work only; mla_up_proj needs MLA, which we do not build.
        names = {part for module in modules for part in recomputed.get(module, [])}
        return sum(parts[name] for name in names)
    return 0.0


def step_flops(cfg: RunConfig, *, samples: int, seq_length: int) -> dict[str, ComponentFlops]:
    """FLOPs of one optimizer step over the world: ``samples`` = global batch, ``seq_length`` = padded decoder
    tokens per sample as run. Returns component -> ComponentFlops, plus ``total``."""
    m, vt = cfg.model, cfg.vision
    images = samples * m.images_per_sample
    encoder_trains = not vt.freeze_encoder
    vision_fwd = images * _vision_forward_per_image(m)
    projector_fwd = images * _projector_forward_per_image(m)
    parts = {k: samples * v for k, v in _decoder_parts_per_sample(m.decoder, seq_length).items()}
    decoder_fwd = sum(parts.values())

    vision_bwd = 0.0 if vt.freeze_encoder else 2.0
    projector_bwd = 2.0 if not vt.freeze_projector else (1.0 if encoder_trains else 0.0)
    stages = cfg.parallel.pp * cfg.parallel.vpp
    recompute = _recomputed_forward(parts, m.decoder, cfg.recompute, stages=stages)

    result = {
        "vision_encoder": ComponentFlops(model=vision_fwd * (1 + vision_bwd), hardware=vision_fwd * (1 + vision_bwd)),
        "projector": ComponentFlops(model=projector_fwd * (1 + projector_bwd),
                                    hardware=projector_fwd * (1 + projector_bwd)),
        "decoder": ComponentFlops(model=3 * decoder_fwd, hardware=3 * decoder_fwd + recompute),
    }
    result["total"] = ComponentFlops(model=sum(c.model for c in result.values()),
                                     hardware=sum(c.hardware for c in result.values()))
    return result
