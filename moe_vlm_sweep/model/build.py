"""RunPlan -> megatron-core TransformerConfigs, layer specs and LLaVAModel chunks.

Three configs, as Megatron-LM's ``pretrain_vlm.py`` builds them: the MoE decoder carries the parallel layout and
every performance knob; the CLIP ViT and the projector run dense on the first pipeline stage (PP=1 in their
configs). Needs ``initialize_model_parallel`` to have run; returns one chunk per virtual pipeline stage.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.models.multimodal.llava_model import LLaVAModel
from megatron.core.models.vision.vit_layer_specs import (
    get_vit_layer_with_local_spec,
    get_vit_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.data.batch import IMAGE_TOKEN_INDEX
from moe_vlm_sweep.model import linear_cross_entropy, wgrad_fusion
from moe_vlm_sweep.plan.plan import RunPlan

logger = logging.getLogger(__name__)


def decoder_config(plan: RunPlan) -> TransformerConfig:
    """The MoE decoder's config: layout, MoE, recompute, dispatcher, fusions, precision, CUDA-graph knobs."""
    cfg = plan.run_config
    d, p, rc, disp, cg, fu = cfg.model.decoder, plan.layout, cfg.recompute, cfg.dispatcher, cfg.cuda_graph, plan.fusions
    te = plan.transformer_impl == "transformer_engine"
    bf16 = plan.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn_hidden_size,
        normalization=d.normalization,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **p.megatron_sizes(),
        sequence_parallel=p.sp,
        num_moe_experts=d.num_experts,
        moe_router_topk=d.moe_router_topk,
        moe_ffn_hidden_size=d.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=d.moe_shared_expert_intermediate_size,
        moe_layer_freq=d.moe_layer_freq,
        moe_aux_loss_coeff=d.moe_aux_loss_coeff,
        moe_router_load_balancing_type="aux_loss" if d.moe_aux_loss_coeff > 0 else "none",
        # Top-1 needs the softmax before the top-k (megatron refuses otherwise): a softmax over the one chosen
        # logit is always 1, which would give the router no gradient.
        moe_router_pre_softmax=d.moe_router_topk == 1,
        moe_grouped_gemm=te,
        moe_token_dispatcher_type=disp.token_dispatcher,
        **({"moe_flex_dispatcher_backend": disp.flex_backend} if disp.flex_backend else {}),
        moe_expert_capacity_factor=disp.capacity_factor,
        moe_pad_expert_input_to_capacity=disp.pad_to_capacity,
        recompute_granularity=None if rc.granularity == "none" else rc.granularity,
        recompute_method=rc.method if rc.granularity == "full" else None,
        recompute_num_layers=(rc.num_layers or 1) if rc.granularity == "full" else None,
        recompute_modules=list(rc.modules) if rc.granularity == "selective" else None,  # named (rules.py)
        bias_dropout_fusion=fu["bias_dropout"],
        apply_rope_fusion=fu["rope"],
        masked_softmax_fusion=fu["masked_softmax"],
        moe_permute_fusion=fu["moe_permute"],
        cross_entropy_loss_fusion=fu["cross_entropy"],
        # Without APEX only TE's layers fuse it (fuse_wgrad_accumulation_in_te_layers): megatron's flag would also
        # reach the output layer, megatron's ColumnParallelLinear, whose constructor raises without APEX
        gradient_accumulation_fusion=wgrad_fusion.fused_layers(plan, wgrad_fusion.apex_built()) == "every_layer",
        bias_activation_fusion=fu["bias_activation"],
        moe_router_fusion=fu["moe_router"],
        cuda_graph_impl=cg.impl,
        cuda_graph_modules=list(cg.modules),
        cuda_graph_warmup_steps=cg.warmup_steps,
        use_te_rng_tracker=plan.graph_rng == "te",
        bf16=bf16,
        # FP8: megatron's TransformerBlock enters TE's fp8_autocast around its layers (fp8_utils.get_fp8_context),
        # so the decoder layers' TE GEMMs run in FP8; what runs outside the block stays bf16
        fp8="hybrid" if plan.fp8_recipe else None,
        **({"fp8_recipe": plan.fp8_recipe} if plan.fp8_recipe else {}),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # Per-token loss: the schedule sums (loss, tokens) over micro-batches and finalize_model_grads divides the
        # gradients by the step's real-token count, so the loss is averaged over real tokens, not micro-batches.
        calculate_per_token_loss=True,
        use_cpu_initialization=plan.device == "cpu",
        variable_seq_lengths=False,
    )


def _dense_copy(base: TransformerConfig, **fields: Any) -> TransformerConfig:
    """A dense, unpipelined sibling of the decoder config (the ViT and the projector live on stage 0)."""
    moe_off = dict(
        num_moe_experts=None,
        moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1,
        moe_grouped_gemm=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_ffn_hidden_size=None,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=base.tensor_model_parallel_size,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )
    pipeline_off = dict(
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False,
        context_parallel_size=1,
    )
    # bias_activation_fusion: megatron's fused GELU is the tanh approximation, so fusing it would change the
    # model; the ViT and projector keep exact GELU whatever the decoder's SwiGLU does
    no_extras: dict[str, Any] = dict(
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=None,
        cuda_graph_impl="none",
        cuda_graph_modules=[],
        inference_cuda_graph_scope=None,
        bias_activation_fusion=False,
        fp8=None,  # the ViT and the projector stay bf16: FP8 is the decoder's (train.precision=fp8)
    )
    kwargs = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    kwargs.update(moe_off, **pipeline_off, **no_extras, **fields)
    kwargs.pop("cuda_graph_scope", None)
    return TransformerConfig(**kwargs)


def vision_config(plan: RunPlan, base: TransformerConfig) -> TransformerConfig:
    v = plan.run_config.model.vision
    config = _dense_copy(
        base,
        num_layers=v.num_layers,
        hidden_size=v.hidden_size,
        num_attention_heads=v.num_attention_heads,
        num_query_groups=v.num_attention_heads,
        kv_channels=v.hidden_size // v.num_attention_heads,
        ffn_hidden_size=v.ffn_hidden_size,
        normalization="LayerNorm",
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
        add_qkv_bias=True,
        apply_rope_fusion=False,
    )
    config.vision_model_type = v.kind  # read by LLaVAModel to pick CLIP or SigLIP
    return config


def projector_config(plan: RunPlan, base: TransformerConfig) -> TransformerConfig:
    pr = plan.run_config.model.projector
    return _dense_copy(
        base,
        ffn_hidden_size=pr.ffn_hidden_size or base.hidden_size,
        gated_linear_unit=False,
        activation_func=F.gelu,
        add_bias_linear=True,
    )


def _decoder_spec(plan: RunPlan, config: TransformerConfig, vp_stage: int | None):
    d = plan.run_config.model.decoder
    te = plan.transformer_impl == "transformer_engine"
    if d.moe_layer_freq == 1:  # one layer spec for all layers (LLaVA's SP check needs a layer spec)
        if te:  # TE's fused norm+linear reads config.normalization itself
            return get_gpt_layer_with_transformer_engine_spec(num_experts=d.num_experts, moe_grouped_gemm=True)
        return get_gpt_layer_local_spec(
            num_experts=d.num_experts, moe_grouped_gemm=False, normalization=d.normalization
        )
    return get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=d.normalization, vp_stage=vp_stage
    )


def _projector_spec(te: bool) -> MLPSubmodules:
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

        return MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear)
    return MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)


def build_model_chunks(plan: RunPlan) -> list[LLaVAModel]:
    """One LLaVAModel per virtual pipeline stage of this rank; encoder on the first stage, loss on the last."""
    cfg: RunConfig = plan.run_config
    m, te = cfg.model, plan.transformer_impl == "transformer_engine"
    if not te:
        from moe_vlm_sweep.model.local_norm import use_torch_norm_in_clip

        use_torch_norm_in_clip()
    lm = decoder_config(plan)
    vis, proj = vision_config(plan, lm), projector_config(plan, lm)
    vit_spec = get_vit_layer_with_transformer_engine_spec() if te else get_vit_layer_with_local_spec()
    vpp = plan.layout.vpp
    chunks = []
    for vp_stage in range(vpp) if vpp > 1 else [None]:
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = LLaVAModel(
            language_transformer_config=lm,
            language_transformer_layer_spec=_decoder_spec(plan, lm, vp_stage),
            language_vocab_size=m.decoder.vocab_size,
            language_max_sequence_length=plan.decoder_row_length,
            vision_transformer_config=vis,
            vision_transformer_layer_spec=vit_spec,
            drop_vision_class_token=m.vision.kind == "clip",
            vision_projection_config=proj,
            vision_projection_layer_spec=_projector_spec(te),
            vision_projection_type=m.projector.kind,
            parallel_output=True,
            language_position_embedding_type="rope",
            language_rotary_base=m.decoder.rotary_base,
            pre_process=first,
            post_process=last,
            add_encoder=first,
            add_decoder=True,
            img_h=m.vision.image_size,
            img_w=m.vision.image_size,
            patch_dim=m.vision.patch_size,
            image_token_index=IMAGE_TOKEN_INDEX,
            pixel_shuffle=m.vision.spatial_merge == 2,
            vp_stage=vp_stage,
        )
        if model.img_seq_len != m.image_tokens:  # the data lays out (and packing offsets) image_tokens per image
            raise ValueError(
                f"LLaVA expands an image to {model.img_seq_len} tokens, but model.image_tokens is "
                f"{m.image_tokens}: the data layout and the FLOPs would not match the model"
            )
        model.freeze(
            freeze_language_model=False,
            freeze_vision_model=cfg.vision.freeze_encoder,
            freeze_vision_projection=cfg.vision.freeze_projector,
        )
        model.model_type = ModelType.encoder_or_decoder  # the pipeline schedules raise without it
        if plan.fusions["linear_cross_entropy"]:
            linear_cross_entropy.install(model.language_model)
        chunks.append(model)
    if wgrad_fusion.fused_layers(plan, wgrad_fusion.apex_built()) == "te_layers":
        fused = fuse_wgrad_accumulation_in_te_layers(chunks)
        logger.info(
            "fusions.gradient_accumulation: TE's weight-gradient fusion in %d trainable TE layers; megatron's own layers (the "
            "output layer) accumulate unfused, as APEX's fused_weight_gradient_mlp_cuda is not importable",
            fused,
        )
    return chunks


def fuse_wgrad_accumulation_in_te_layers(chunks: list[LLaVAModel]) -> int:
    """Turns on TE's own weight-gradient accumulation fusion in every TE layer of ``chunks`` with a trainable
    weight (a frozen one has no gradient to accumulate); returns how many.

    The same switch megatron-core's ``gradient_accumulation_fusion`` passes each TE layer at construction
    (``fuse_wgrad_accumulation``), which TE reads at every forward: the layer's weight-gradient GEMM accumulates
    into DDP's fp32 ``main_grad`` and sets ``grad_added_to_main_grad`` on every backward, and megatron's DDP
    backward hook then adds no second copy (``distributed_data_parallel.py``). Megatron-FSDP has TE overwrite
    ``main_grad`` instead (``overwrite_main_grad``), a path not checked here: the worker's preflight rejects it."""
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    fused = 0
    for chunk in chunks:
        for module in chunk.modules():
            trainable = any(p.requires_grad for p in module.parameters(recurse=False))
            if (
                isinstance(module, TransformerEngineBaseModule)
                and hasattr(module, "fuse_wgrad_accumulation")
                and trainable
            ):
                module.fuse_wgrad_accumulation = True
                fused += 1
    return fused


def precision_scope(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    """After training: which of this rank's matrix-holding modules ran their last forward in FP8, as TE itself
    recorded it (``TransformerEngineBaseModule.fp8``, set from TE's global FP8 state on each forward), counted by
    name with layer numbers as ``*`` ([name, count] pairs), and the TE recipe classes they ran (TE's own, under
    megatron's wrappers). megatron's ``TransformerBlock.forward`` enters ``fp8_autocast`` around the decoder
    layers only (``fp8_utils.get_fp8_context``), so the ViT, the projector, the embedding, the router and the
    output layer land in ``bf16_modules``."""
    import re

    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule

    fp8: dict[str, int] = {}
    bf16: dict[str, int] = {}
    recipes: set[str] = set()
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not any(p.dim() >= 2 for p in module.parameters(recurse=False)):
                continue
            ran_fp8 = isinstance(module, TransformerEngineBaseModule) and bool(getattr(module, "fp8", False))
            if ran_fp8 and (recipe := module.fp8_meta.get("recipe")) is not None:
                # TE's own class (megatron wraps DelayedScaling as TEDelayedScaling)
                recipes.add(
                    next(c for c in type(recipe).__mro__ if c.__module__.startswith("transformer_engine")).__name__
                )
            counts = fp8 if ran_fp8 else bf16
            key = re.sub(r"\.\d+(?=\.|$)", ".*", name.removeprefix("module."))
            counts[key] = counts.get(key, 0) + 1
    # [name, count] pairs, not a mapping: tracking would log a mapping's numbers as metrics named after the modules
    return {"te_recipes": sorted(recipes), "fp8_modules": sorted(fp8.items()), "bf16_modules": sorted(bf16.items())}
