"""Analytic FLOPs of one optimizer step, per component (vision encoder, projector, decoder): the one place.

Two counts per component, both from the step's actual batch (:class:`BatchTokens`):

- **useful** (``model``, the MFU numerator): the work training needs. Decoder over real tokens only (padding is
  wasted work), causal attention over the real query-key pairs ``L (L + 1) / 2`` of each sample, top-k experts.
- **executed** (``hardware``, the HFU numerator): what the kernels run. Decoder over every padded position,
  attention as the kernel computes it (the local ``DotProductAttention`` computes the full ``S x S`` square and
  masks it; flash kernels skip masked tiles, counted as the causal triangle), plus recomputed forwards. A
  packed batch (``data.packing``) has no padded positions: TE's THD attention runs each sample's own triangle,
  the local one the whole packed row's square, masked block-causally.

Counting rules (a multiply-add is 2 FLOPs; only matmuls and the patch convolution count: norms, activations,
softmax, RoPE, permutes and the loss are elementwise and ignored):

- Forward 1x. Backward per matmul: the weight gradient (1x) if its weight trains, the input gradient (1x) if any
  trainable weight sits before it. So a trainable module costs 2x backward, a frozen one its input-gradient 1x
  only when a trainable module sits before it, else nothing.
- Pixels need no gradient, so the patch embedding has no input gradient (autograd does not run one) and a frozen
  encoder has no backward at all. Behind a frozen encoder the projector's first layer needs no input gradient
  either; megatron's linear layers compute it anyway: executed, not useful.
- Recompute is never useful: it adds to executed FLOPs only.

Executed and useful are the same function of (tokens, attention pairs) per component: executed evaluates it at
the padded shapes, useful at the real ones. tests/test_flops.py checks executed against
``torch.utils.flop_counter.FlopCounterMode`` on the real model and rebuilds useful from measured coefficients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from moe_vlm_sweep.config.schema import DecoderConf, ModelConf, RecomputeConf, RunConfig
from moe_vlm_sweep.metrics.schema import ComponentFlops

ACCOUNTING_NOTES = (
    "FLOPs count matmuls and the patch convolution only (2 per multiply-add); norms, activations, softmax, RoPE "
    "and the loss are ignored.",
    "Useful FLOPs (MFU) count the decoder over real tokens (text that is not padding plus image tokens) and "
    "causal attention over real query-key pairs L(L+1)/2; executed FLOPs (HFU) count every padded position, "
    "attention as the kernel runs it (local: the full square, masked; flash: the causal triangle) and recompute.",
    "A frozen module's backward is its input gradient only, and only when a trainable module sits before it; "
    "behind a frozen encoder the projector's first-layer input gradient is executed (megatron computes it) but "
    "not useful.",
    "MoE experts count exactly top-k per token: tokens dropped or padded by a capacity factor are not modelled.",
    "The vision encoder (CLS token included) attends without a mask over one image's tokens; it is never "
    "recomputed (recompute knobs apply to the decoder only).",
    "Per-step FLOPs and tokens are means over the measured steps (batches vary per step); per-GPU rates divide "
    "world FLOPs by world size, so pipeline bubbles and idle ranks lower MFU.",
)


SUMMED_FIELDS = ("samples", "images", "real_tokens", "real_attention_pairs", "packed_row_squares")
"""The BatchTokens fields that add up over micro-batches, data-parallel replicas and steps."""


@dataclass(frozen=True, kw_only=True)
class BatchTokens:
    """What one step's FLOPs depend on, summed over the samples of the step (all micro-batches, all DP ranks).

    Floats, so that a mean over steps is again a ``BatchTokens``: every count below is linear in these fields.
    """

    samples: float
    images: float
    """Images that reach the vision encoder (0 for text-only data)."""
    real_tokens: float
    """Decoder tokens that are not padding: real text plus every image's tokens (the effective tokens)."""
    real_attention_pairs: float
    """Sum over samples of L (L + 1) / 2: the query-key pairs causal attention needs over the real tokens."""
    packed_row_squares: float = 0.0
    """Sum over packed rows of T**2: the square megatron's local attention computes over a row of T tokens (and
    masks block-causally). 0 for padded batches."""
    seq_length: int
    """Decoder tokens per sample as planned (padding included, after LLaVA's sequence-shard padding); packed, an
    upper bound of every sample's."""
    packed: bool = False
    """The samples ran back to back without padding (``data.packing``)."""

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], *, images: int, seq_length: int, packed: bool = False) -> BatchTokens:
        """From the real decoder length of each sample (``MicroBatch.decoder_lengths``); packed, the samples of
        one row (a micro-batch)."""
        lengths = [int(n) for n in lengths]
        if any(not 0 < n <= seq_length for n in lengths):
            raise ValueError(f"decoder lengths {lengths} must lie in (0, seq_length={seq_length}]")
        return cls(
            samples=len(lengths),
            images=images,
            real_tokens=sum(lengths),
            real_attention_pairs=sum(n * (n + 1) // 2 for n in lengths),
            packed_row_squares=sum(lengths) ** 2 if packed else 0,
            seq_length=seq_length,
            packed=packed,
        )

    @classmethod
    def unpadded(cls, *, samples: int, images: int, seq_length: int) -> BatchTokens:
        """Every sample fills the whole sequence (a planner's estimate before any batch exists)."""
        return cls.from_lengths([seq_length] * samples, images=images, seq_length=seq_length)

    @property
    def padded_tokens(self) -> float:
        """Decoder positions the step computes on."""
        return self.real_tokens if self.packed else self.samples * self.seq_length

    def executed_attention_pairs(self, transformer_impl: str) -> float:
        """Query-key pairs the step's attention kernels compute."""
        if self.packed:  # local: each row's square, masked; TE's THD: each sample's triangle (masked tiles skipped)
            return self.packed_row_squares if transformer_impl == "local" else self.real_attention_pairs
        return self.samples * executed_attention_pairs(self.seq_length, transformer_impl)

    @classmethod
    def total(cls, batches: Sequence[BatchTokens]) -> BatchTokens:
        """The batches together (micro-batches of a step): every field adds up."""
        if not batches or len({(b.seq_length, b.packed) for b in batches}) != 1:
            raise ValueError(
                f"need batches of one seq_length and packing, got {[(b.seq_length, b.packed) for b in batches]}"
            )
        return cls(
            **{name: sum(getattr(b, name) for b in batches) for name in SUMMED_FIELDS},
            seq_length=batches[0].seq_length,
            packed=batches[0].packed,
        )

    @classmethod
    def mean(cls, batches: Sequence[BatchTokens]) -> BatchTokens:
        """The mean step: FLOPs and token counts are linear in every field, so they average with it."""
        total = cls.total(batches)
        return dataclasses.replace(total, **{name: getattr(total, name) / len(batches) for name in SUMMED_FIELDS})


@dataclass(frozen=True, kw_only=True)
class Work:
    """One component's FLOPs over one step, forward and backward apart (the FlopCounterMode test checks both)."""

    useful_forward: float
    useful_backward: float
    executed_forward: float
    executed_backward: float
    """Recomputed forwards included: they run during the backward pass."""

    @property
    def flops(self) -> ComponentFlops:
        return ComponentFlops(
            model=self.useful_forward + self.useful_backward, hardware=self.executed_forward + self.executed_backward
        )


def _vision_forward_per_image(model: ModelConf) -> tuple[float, float]:
    """(whole encoder, patch embedding) forward FLOPs of one image: every patch is real, no padding."""
    v = model.vision
    patches = v.patches_per_image
    s = patches + (v.class_token_len if v.kind == "clip" else 0)
    h = v.hidden_size
    patch_embed = 2 * patches * 3 * v.patch_size**2 * h  # a conv with stride = kernel = patch: one matmul
    projections = 2 * s * 4 * h * h  # q, k, v, o: full multi-head attention
    scores_and_values = 2 * 2 * s * s * h  # Q K^T and A V, bidirectional (no mask): all pairs are useful
    mlp = 2 * s * 2 * h * v.ffn_hidden_size  # GELU MLP: fc1 and fc2
    return patch_embed + v.num_layers * (projections + scores_and_values + mlp), patch_embed


def _projector_forward_per_image(model: ModelConf) -> tuple[float, float]:
    """(whole projector, first layer) forward FLOPs of one image."""
    tokens = model.vision.tokens_per_image
    width_in = model.vision.hidden_size * model.vision.spatial_merge**2  # merged patches are concatenated
    out = model.decoder.hidden_size
    if model.projector.kind == "affine":
        return 2 * tokens * width_in * out, 2 * tokens * width_in * out
    ffn = model.projector.ffn_hidden_size or out
    return 2 * tokens * (width_in * ffn + ffn * out), 2 * tokens * width_in * ffn


def decoder_forward_parts(d: DecoderConf, *, tokens: float, attention_pairs: float) -> dict[str, float]:
    """Decoder forward FLOPs of ``tokens`` positions whose causal attention covers ``attention_pairs`` query-key
    pairs; split so that recompute can re-add exactly the recomputed parts. Linear in both arguments."""
    h, hd = d.hidden_size, d.head_dim
    q_width, kv_width = d.num_attention_heads * hd, d.num_query_groups * hd  # GQA: fewer K/V heads
    dense_layers = d.num_layers - d.num_moe_layers
    return {
        "attn_proj": d.num_layers * 2 * tokens * (h * (q_width + 2 * kv_width) + q_width * h),
        # Q K^T and A V: per query-key pair, head_dim multiply-adds per query head, each. GQA shares K/V heads
        # but every query head still scores every key, so the attention core does not shrink with GQA.
        "core_attn": d.num_layers * 2 * 2 * attention_pairs * q_width,
        "router": d.num_moe_layers * 2 * tokens * h * d.num_experts,
        # SwiGLU expert: fc1 h -> 2f (gate and up), fc2 f -> h: 3 h f multiply-adds per token per expert; only
        # the top-k routed experts run (dropless).
        "experts": d.num_moe_layers * d.moe_router_topk * 2 * tokens * 3 * h * d.moe_ffn_hidden_size,
        "shared_experts": d.num_moe_layers * 2 * tokens * 3 * h * (d.moe_shared_expert_intermediate_size or 0),
        "dense_mlp": dense_layers * 2 * tokens * 3 * h * d.ffn_hidden_size,
        "output_layer": 2 * tokens * h * d.vocab_size,
    }


def executed_attention_pairs(seq_length: int, transformer_impl: str) -> int:
    """Query-key pairs one padded sample's causal attention kernel computes."""
    if transformer_impl == "local":
        return seq_length * seq_length  # DotProductAttention: baddbmm/bmm over the square, then the mask
    return seq_length * (seq_length + 1) // 2  # flash kernels skip fully masked tiles (diagonal tiles: approx.)


def _recomputed_forward(parts: dict[str, float], d: DecoderConf, rc: RecomputeConf, *, stages: int) -> float:
    """Decoder forward FLOPs that recompute runs a second time in the backward pass."""
    layer_total = sum(v for k, v in parts.items() if k != "output_layer")
    if rc.granularity == "full":
        if rc.method == "block" and rc.num_layers is not None:
            return layer_total * min(rc.num_layers * stages, d.num_layers) / d.num_layers
        return layer_total  # uniform: every layer is recomputed, in chunks of num_layers
    if rc.granularity == "selective":
        modules = rc.modules  # named (rules.py)
        recomputed = {
            "core_attn": ["core_attn"],
            "moe": ["router", "experts", "shared_experts"],
            "mlp": ["dense_mlp"],
            "shared_experts": ["shared_experts"],
        }
        # moe_act and layernorm recompute elementwise work only; mla_up_proj needs MLA, which we do not build.
        names = {part for module in modules for part in recomputed.get(module, [])}
        return sum(parts[name] for name in names)
    return 0.0


def component_work(cfg: RunConfig, batch: BatchTokens, *, transformer_impl: str) -> dict[str, Work]:
    """Component -> forward/backward FLOPs, useful and executed, of one step over the world."""
    m, vt = cfg.model, cfg.vision
    encoder_trains, projector_trains = not vt.freeze_encoder, not vt.freeze_projector

    vision_fwd, patch_embed = (batch.images * f for f in _vision_forward_per_image(m))
    # Trainable: weight and input gradients of every matmul but the patch embedding's input gradient (pixels).
    vision_bwd = 2 * vision_fwd - patch_embed if encoder_trains else 0.0

    projector_fwd, first_layer = (batch.images * f for f in _projector_forward_per_image(m))
    weight_grads = projector_fwd if projector_trains else 0.0
    if encoder_trains:
        useful_input_grads = executed_input_grads = projector_fwd
    else:  # nothing trainable before the first layer: its input gradient is useless; megatron computes it if
        # the projector trains (its linear backward always does), autograd skips the whole frozen chain if not
        useful_input_grads = projector_fwd - first_layer if projector_trains else 0.0
        executed_input_grads = projector_fwd if projector_trains else 0.0

    d = m.decoder
    useful = decoder_forward_parts(d, tokens=batch.real_tokens, attention_pairs=batch.real_attention_pairs)
    executed = decoder_forward_parts(
        d, tokens=batch.padded_tokens, attention_pairs=batch.executed_attention_pairs(transformer_impl)
    )
    recompute = _recomputed_forward(executed, d, cfg.recompute, stages=cfg.parallel.pp * cfg.parallel.vpp)
    # The decoder always trains and its embedding table sits before layer 0: backward is 2x everywhere.
    return {
        "vision_encoder": Work(
            useful_forward=vision_fwd,
            useful_backward=vision_bwd,
            executed_forward=vision_fwd,
            executed_backward=vision_bwd,
        ),
        "projector": Work(
            useful_forward=projector_fwd,
            useful_backward=weight_grads + useful_input_grads,
            executed_forward=projector_fwd,
            executed_backward=weight_grads + executed_input_grads,
        ),
        "decoder": Work(
            useful_forward=sum(useful.values()),
            useful_backward=2 * sum(useful.values()),
            executed_forward=sum(executed.values()),
            executed_backward=2 * sum(executed.values()) + recompute,
        ),
    }


def step_flops(cfg: RunConfig, batch: BatchTokens, *, transformer_impl: str) -> dict[str, ComponentFlops]:
    """FLOPs of one optimizer step over the world: component -> ComponentFlops (useful ``model``, executed
    ``hardware``), plus ``total``."""
    result = {name: work.flops for name, work in component_work(cfg, batch, transformer_impl=transformer_impl).items()}
    result["total"] = ComponentFlops(
        model=sum(c.model for c in result.values()), hardware=sum(c.hardware for c in result.values())
    )
    return result
