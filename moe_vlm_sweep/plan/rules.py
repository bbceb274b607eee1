"""Every cross-field rule a run must satisfy before it may cost a process, in one module.

Each rule is a small function of the whole ``RunConfig`` returning a message (knob, value, rule) or None. They
mirror what megatron-core 0.19 enforces at build or training time (``TransformerConfig.__post_init__``,
``parallel_state``, the MoE layer, LLaVA) plus what this product's worker supports, so a bad layout is found
on a laptop or login node instead of after a cluster queue. Rules are pure: what depends on the machine (TE or
DeepEP installed, GPUs present) is the worker's preflight, and a rule that needs a machine fact (the cuDNN
version) takes it as an argument and is called from there.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.plan.layout import seq_padding_factor, sharded_seq_length
from moe_vlm_sweep.plan.memory import estimate

Rule = Callable[[RunConfig], Optional[str]]
RULES: list[Rule] = []


class ConfigError(ValueError):
    """A config breaks one or more rules; the message lists each, naming knob, value and rule."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in self.problems))


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def broken_rules(cfg: RunConfig) -> list[str]:
    return [msg for check in RULES if (msg := check(cfg))]


def _world(cfg: RunConfig) -> int:
    return cfg.launcher.world_size


def _dp(cfg: RunConfig) -> int:
    p = cfg.parallel
    return _world(cfg) // (p.tp * p.pp * p.cp)


def _uses_te(cfg: RunConfig) -> bool:
    return cfg.train.resolved_transformer_impl(cfg.hardware.device) == "transformer_engine"


def _all_layers_moe(cfg: RunConfig) -> bool:
    return cfg.model.decoder.moe_layer_freq == 1


def _drop_and_pad(cfg: RunConfig) -> bool:
    return cfg.dispatcher.capacity_factor is not None and cfg.dispatcher.pad_to_capacity


# --- launcher and hardware ---------------------------------------------------------------------------------

@rule
def local_launcher_is_one_process(cfg: RunConfig) -> Optional[str]:
    if cfg.launcher.name == "local" and _world(cfg) != 1:
        return (f"launcher.nproc_per_node={cfg.launcher.nproc_per_node} with launcher.nnodes={cfg.launcher.nnodes}: "
                "launcher=local runs one process; use launcher=torchrun for a world size > 1")


@rule
def processes_fit_the_node(cfg: RunConfig) -> Optional[str]:
    if cfg.launcher.nproc_per_node > cfg.hardware.gpus_per_node:
        return (f"launcher.nproc_per_node={cfg.launcher.nproc_per_node} must be <= "
                f"hardware.gpus_per_node={cfg.hardware.gpus_per_node} (hardware={cfg.hardware.name})")


@rule
def te_needs_gpu(cfg: RunConfig) -> Optional[str]:
    if cfg.hardware.device == "cpu" and cfg.train.transformer_impl == "transformer_engine":
        return "train.transformer_impl=transformer_engine needs GPU hardware, not hardware=cpu"


@rule
def cuda_graphs_need_gpu(cfg: RunConfig) -> Optional[str]:
    if cfg.hardware.device == "cpu" and cfg.cuda_graph.impl != "none":
        return f"cuda_graph.impl={cfg.cuda_graph.impl} needs GPU hardware, not hardware=cpu"


@rule
def fusions_need_gpu(cfg: RunConfig) -> Optional[str]:
    if cfg.hardware.device == "cpu":
        on = [name for name in cfg.fusions.GPU_ONLY if getattr(cfg.fusions, name)]
        if on:
            return f"fusions.{on[0]}=true needs GPU hardware (CUDA kernels), not hardware=cpu"


@rule
def allocator_setting_needs_gpu(cfg: RunConfig) -> Optional[str]:
    if cfg.hardware.device == "cpu" and cfg.train.expandable_segments:
        return ("train.expandable_segments=true configures the CUDA caching allocator; it needs GPU hardware, "
                "not hardware=cpu")


# --- layout ------------------------------------------------------------------------------------------------

@rule
def dense_layout_divides_world(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if _world(cfg) % (p.tp * p.pp * p.cp):
        return (f"parallel.tp*pp*cp={p.tp}*{p.pp}*{p.cp}={p.tp * p.pp * p.cp} must divide the world size "
                f"{_world(cfg)} (launcher.nproc_per_node * launcher.nnodes)")


@rule
def expert_layout_divides_world(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if _world(cfg) % (p.etp * p.ep * p.pp):
        return (f"parallel.etp*ep*pp={p.etp}*{p.ep}*{p.pp}={p.etp * p.ep * p.pp} must divide the world size "
                f"{_world(cfg)}")


@rule
def tp_divides_heads(cfg: RunConfig) -> Optional[str]:
    d = cfg.model.decoder
    if d.num_attention_heads % cfg.parallel.tp:
        return f"parallel.tp={cfg.parallel.tp} must divide model.decoder.num_attention_heads={d.num_attention_heads}"


@rule
def tp_divides_query_groups(cfg: RunConfig) -> Optional[str]:
    d = cfg.model.decoder
    if d.num_query_groups % cfg.parallel.tp:
        return f"parallel.tp={cfg.parallel.tp} must divide model.decoder.num_query_groups={d.num_query_groups}"


@rule
def tp_divides_vision_heads(cfg: RunConfig) -> Optional[str]:
    v = cfg.model.vision
    if v.num_attention_heads % cfg.parallel.tp:
        return (f"parallel.tp={cfg.parallel.tp} must divide model.vision.num_attention_heads={v.num_attention_heads} "
                "(the ViT runs with the decoder's TP)")


@rule
def pp_divides_layers(cfg: RunConfig) -> Optional[str]:
    p, layers = cfg.parallel, cfg.model.decoder.num_layers
    if layers % (p.pp * p.vpp):
        return (f"parallel.pp*vpp={p.pp}*{p.vpp} must divide model.decoder.num_layers={layers} "
                "(every pipeline chunk holds the same number of layers)")


@rule
def vpp_needs_pp(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.vpp > 1 and cfg.parallel.pp == 1:
        return f"parallel.vpp={cfg.parallel.vpp} needs parallel.pp > 1 (interleaving splits pipeline stages)"


@rule
def ep_divides_experts(cfg: RunConfig) -> Optional[str]:
    if cfg.model.decoder.num_experts % cfg.parallel.ep:
        return f"parallel.ep={cfg.parallel.ep} must divide model.decoder.num_experts={cfg.model.decoder.num_experts}"


@rule
def etp_divides_expert_ffn(cfg: RunConfig) -> Optional[str]:
    d = cfg.model.decoder
    if d.moe_ffn_hidden_size % cfg.parallel.etp:
        return (f"parallel.etp={cfg.parallel.etp} must divide "
                f"model.decoder.moe_ffn_hidden_size={d.moe_ffn_hidden_size}")


@rule
def sp_needs_tp(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        return "parallel.sp=true needs parallel.tp > 1 (sequence parallel splits along the TP group)"


@rule
def moe_with_tp_needs_sp(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.tp > 1 and not cfg.parallel.sp:
        return (f"parallel.tp={cfg.parallel.tp} with MoE layers needs parallel.sp=true "
                "(megatron-core's MoE layer raises during training otherwise)")


@rule
def sp_needs_uniform_layers(cfg: RunConfig) -> Optional[str]:
    freq = cfg.model.decoder.moe_layer_freq
    if (cfg.parallel.sp or cfg.parallel.cp > 1) and freq > 1:
        return (f"model.decoder.moe_layer_freq={freq} with parallel.sp/cp: megatron-core's LLaVA checks a single "
                "layer spec under sequence or context parallelism, and mixed dense/MoE layers need a block spec")


@rule
def cp_divides_sequence(cfg: RunConfig) -> Optional[str]:
    seq, cp = cfg.model.seq_length, cfg.parallel.cp
    if cp > 1 and seq % (2 * cp):
        return (f"parallel.cp={cp} needs the decoder sequence length {seq} to be divisible by 2*cp={2 * cp} "
                "(load-balanced causal chunks)")


@rule
def cp_needs_te(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.cp > 1 and not _uses_te(cfg):
        return (f"parallel.cp={cfg.parallel.cp} needs Transformer Engine attention "
                "(megatron-core's local DotProductAttention supports cp=1 only)")


@rule
def fsdp_has_no_pipeline(cfg: RunConfig) -> Optional[str]:
    if cfg.parallel.strategy == "fsdp" and cfg.parallel.pp > 1:
        return f"parallel.pp={cfg.parallel.pp} with parallel=fsdp: Megatron-FSDP does not pipeline; use parallel=3d"


@rule
def gbs_divisible_by_mbs_dp(cfg: RunConfig) -> Optional[str]:
    b, dp = cfg.batch, _dp(cfg)
    if dp >= 1 and b.gbs % (b.mbs * dp):
        return f"batch.gbs={b.gbs} must be divisible by batch.mbs*dp={b.mbs}*{dp}={b.mbs * dp}"


# --- model shape -------------------------------------------------------------------------------------------

@rule
def spatial_merge_needs_even_grid(cfg: RunConfig) -> Optional[str]:
    v = cfg.model.vision
    grid = v.image_size // v.patch_size
    if v.spatial_merge > 1 and grid % v.spatial_merge:
        return (f"model.vision.spatial_merge={v.spatial_merge} must divide the patch grid side {grid} "
                f"(model.vision.image_size / model.vision.patch_size)")


# --- recompute ---------------------------------------------------------------------------------------------

@rule
def selective_needs_modules(cfg: RunConfig) -> Optional[str]:
    r = cfg.recompute
    if r.granularity == "selective" and not r.modules:
        return "recompute.modules=[] with recompute=selective: name at least one module (e.g. core_attn)"
    if r.granularity != "selective" and r.modules:
        return f"recompute.modules={r.modules} applies to recompute=selective only, not {r.granularity}"


@rule
def full_recompute_fields(cfg: RunConfig) -> Optional[str]:
    r = cfg.recompute
    if r.granularity == "full" and (r.method is None or r.num_layers is None):
        return "recompute=full needs recompute.method (uniform|block) and recompute.num_layers"
    if r.granularity != "full" and (r.method is not None or r.num_layers is not None):
        return f"recompute.method/recompute.num_layers apply to recompute=full only, not {r.granularity}"


@rule
def recompute_layers_fit_stage(cfg: RunConfig) -> Optional[str]:
    r, p = cfg.recompute, cfg.parallel
    per_chunk = cfg.model.decoder.num_layers // (p.pp * p.vpp)
    if r.granularity == "full" and r.num_layers is not None and r.num_layers > per_chunk:
        return (f"recompute.num_layers={r.num_layers} must be <= the {per_chunk} decoder layers of one pipeline "
                "chunk")


@rule
def moe_act_recompute_needs_te(cfg: RunConfig) -> Optional[str]:
    if "moe_act" in cfg.recompute.modules and not _uses_te(cfg):
        return "recompute.modules contains moe_act, which needs TE grouped GEMM (train.transformer_impl=transformer_engine)"


@rule
def mla_recompute_needs_mla(cfg: RunConfig) -> Optional[str]:
    if "mla_up_proj" in cfg.recompute.modules:
        return "recompute.modules contains mla_up_proj, which needs multi-latent attention; these models use GQA"


@rule
def mlp_recompute_needs_dense_layers(cfg: RunConfig) -> Optional[str]:
    if "mlp" in cfg.recompute.modules and _all_layers_moe(cfg):
        return ("recompute.modules contains mlp, which recomputes dense MLPs; every layer is MoE "
                "(model.decoder.moe_layer_freq=1): use moe or moe_act")


@rule
def shared_expert_recompute_needs_shared_experts(cfg: RunConfig) -> Optional[str]:
    if "shared_experts" in cfg.recompute.modules and not cfg.model.decoder.moe_shared_expert_intermediate_size:
        return ("recompute.modules contains shared_experts, but "
                "model.decoder.moe_shared_expert_intermediate_size is not set")


# --- CUDA graphs -------------------------------------------------------------------------------------------

@rule
def graph_modules_need_impl(cfg: RunConfig) -> Optional[str]:
    g = cfg.cuda_graph
    if g.impl == "none" and g.modules:
        return f"cuda_graph.modules={g.modules} needs cuda_graph.impl local or transformer_engine, not none"


@rule
def full_iteration_takes_no_modules(cfg: RunConfig) -> Optional[str]:
    g = cfg.cuda_graph
    if g.impl == "full_iteration" and g.modules:
        return f"cuda_graph.modules={g.modules} must be empty with cuda_graph.impl=full_iteration"


@rule
def full_iteration_cannot_capture_llava(cfg: RunConfig) -> Optional[str]:
    if cfg.cuda_graph.impl == "full_iteration":
        return ("cuda_graph.impl=full_iteration cannot capture LLaVAModel: its _preprocess_data calls .tolist() "
                "(a host sync) inside the step; use cuda_graph=attn or a layer scope")


@rule
def graph_moe_scopes_exclusive(cfg: RunConfig) -> Optional[str]:
    m = cfg.cuda_graph.modules
    if "moe" in m and "moe_router" in m:
        return "cuda_graph.modules contains both moe and moe_router; they are exclusive (moe graphs the router too)"


@rule
def graph_preprocess_needs_router(cfg: RunConfig) -> Optional[str]:
    if "moe_preprocess" in cfg.cuda_graph.modules and "moe_router" not in cfg.cuda_graph.modules:
        return "cuda_graph.modules contains moe_preprocess, which needs moe_router as well"


@rule
def graph_mlp_needs_dense_layers(cfg: RunConfig) -> Optional[str]:
    if "mlp" in cfg.cuda_graph.modules and _all_layers_moe(cfg):
        return "cuda_graph.modules contains mlp, but every layer is MoE (model.decoder.moe_layer_freq=1): use moe"


@rule
def graph_mamba_needs_mamba(cfg: RunConfig) -> Optional[str]:
    if "mamba" in cfg.cuda_graph.modules:
        return "cuda_graph.modules contains mamba, but these decoders have no Mamba layers"


@rule
def graph_moe_needs_drop_and_pad(cfg: RunConfig) -> Optional[str]:
    g = cfg.cuda_graph
    whole_layers = g.impl == "transformer_engine" and not g.modules
    if ("moe" in g.modules or whole_layers) and not _drop_and_pad(cfg):
        scope = "contains moe" if g.modules else "is empty (whole layers, experts included)"
        return (f"cuda_graph.modules {scope}, which needs drop-and-pad (static shapes): set "
                "dispatcher.capacity_factor and dispatcher.pad_to_capacity=true")


@rule
def graph_preprocess_vs_alltoall_capacity(cfg: RunConfig) -> Optional[str]:
    d = cfg.dispatcher
    if ("moe_preprocess" in cfg.cuda_graph.modules and d.token_dispatcher == "alltoall"
            and d.capacity_factor is not None):
        return (f"cuda_graph.modules contains moe_preprocess, which megatron-core rejects for dispatcher=alltoall "
                f"with dispatcher.capacity_factor={d.capacity_factor}")


@rule
def local_graphs_need_drop_and_pad(cfg: RunConfig) -> Optional[str]:
    if cfg.cuda_graph.impl == "local" and not _drop_and_pad(cfg):
        return ("cuda_graph.impl=local cannot capture dropless MoE (cudaErrorCapturedEvent in the dispatcher): set "
                "dispatcher.capacity_factor and dispatcher.pad_to_capacity=true")


@rule
def full_recompute_only_with_full_iteration(cfg: RunConfig) -> Optional[str]:
    if cfg.recompute.granularity == "full" and cfg.cuda_graph.impl in ("local", "transformer_engine"):
        return (f"recompute=full with cuda_graph.impl={cfg.cuda_graph.impl}: megatron-core allows full recompute "
                "only with full_iteration graphs; use recompute=selective or cuda_graph=none")


@rule
def moe_recompute_excludes_router_graph(cfg: RunConfig) -> Optional[str]:
    if (cfg.cuda_graph.impl == "transformer_engine" and "moe" in cfg.recompute.modules
            and "moe_router" in cfg.cuda_graph.modules):
        return ("recompute.modules contains moe while cuda_graph.modules contains moe_router: a recomputed MoE "
                "block cannot hold a TE-graphed router")


@rule
def graph_warmup_within_warmup(cfg: RunConfig) -> Optional[str]:
    g, t = cfg.cuda_graph, cfg.train
    if g.impl == "transformer_engine" and g.warmup_steps >= t.warmup_steps:
        return (f"cuda_graph.warmup_steps={g.warmup_steps} must be < train.warmup_steps={t.warmup_steps}: TE "
                "graphs are captured after cuda_graph.warmup_steps eager steps, and at least one graphed warmup "
                "step must follow before the timed steps")


@rule
def trace_needs_profile_steps(cfg: RunConfig) -> Optional[str]:
    if cfg.train.trace and cfg.train.profile_steps == 0:
        return "train.trace=true traces the profile steps, but train.profile_steps=0: set it to 1 or more"


@rule
def layer_graphs_vs_fsdp(cfg: RunConfig) -> Optional[str]:
    impl, p = cfg.cuda_graph.impl, cfg.parallel
    if p.strategy != "fsdp":
        return None
    if impl == "transformer_engine":
        return ("cuda_graph.impl=transformer_engine with parallel=fsdp: TE make_graphed_callables refuses modules "
                "with hooks, and Megatron-FSDP registers them on every layer (seen on the H200); use parallel=3d")
    if impl == "local" and p.fsdp_sharding == "optim_grads_params":
        return ("cuda_graph.impl=local with parallel.fsdp_sharding=optim_grads_params: Megatron-FSDP gathers each "
                "layer's parameters in forward hooks that a graph replay skips; use parallel=3d")


@rule
def te_graphs_need_te_specs(cfg: RunConfig) -> Optional[str]:
    if cfg.cuda_graph.impl == "transformer_engine" and cfg.hardware.device == "cuda" and not _uses_te(cfg):
        return ("cuda_graph.impl=transformer_engine captures through TE make_graphed_callables, which needs "
                "train.transformer_impl=transformer_engine (the local specs are graphed by cuda_graph=layer_local)")


def _cudnn(version: int) -> str:
    """A cuDNN version as TE and cudnnGetVersion encode it (91501), as people write it (9.15.1)."""
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


CUDNN_GRAPHED_ATTENTION_FIX = 91501
"""The cuDNN runtime (9.15.1, encoded as TE and cudnnGetVersion do) from which TE keeps fused attention inside
CUDA-graph capture whatever the sequence length (``nvte_get_fused_attn_backend``, TE 2.20)."""


def graphs_unfuse_attention(cfg: RunConfig, cudnn_version: int, flash_attn: bool = False) -> Optional[str]:
    """Not a registered rule: the worker's preflight passes the runtime cuDNN and whether flash-attn is installed.
    With cuDNN <= 9.15.0, TE refuses fused attention while a graph is captured unless every (SBHD, non-padding) KV
    length it checks is a multiple of 128. Without CP it then silently runs unfused attention: on the H200 0.47-0.63x
    the eager step and 1.9x its memory (benchmarks/results/h200_graphs_cudnn/), a trap, not a config worth
    measuring; flash-attn, where installed, would take over instead. With CP, TE checks each ring step (KV chunks
    down to seq / (2 cp)) and has no other backend, so the capture fails. The length TE checks is the one LLaVA
    pads for SP and CP, and the fix it suggests is a text length whose padded sequence is a multiple."""
    g, cp, seq = cfg.cuda_graph, cfg.parallel.cp, sharded_seq_length(cfg)
    graphs_attention = g.impl in ("local", "transformer_engine") and (not g.modules or "attn" in g.modules)
    multiple = 128 if cp == 1 else 256 * cp
    if (not graphs_attention or not _uses_te(cfg) or cudnn_version >= CUDNN_GRAPHED_ATTENTION_FIX
            or seq % multiple == 0 or (cp == 1 and flash_attn)):
        return None
    factor = seq_padding_factor(cfg)
    step = math.lcm(multiple, factor)
    fixed = -(-cfg.model.seq_length // step) * step  # the padded length to reach; padding adds up to factor - 1
    text_tokens = cfg.model.text_tokens + max(0, fixed - factor + 1 - cfg.model.seq_length)
    version = _cudnn(cudnn_version)
    if cp == 1:
        lengths = f"{seq} decoder tokens" + (f", {cfg.model.seq_length} padded for SP" if seq != cfg.model.seq_length
                                              else "")
        effect = "runs unfused attention instead (about half the eager speed, twice the memory)"
    else:
        lengths, effect = (f"parallel.cp={cp} ring chunks of {seq} decoder tokens, down to {seq / (2 * cp):g}",
                           "has no other attention backend under context parallelism, so the capture fails")
    return (f"cuda_graph={g.scope} graphs decoder attention, but with cuDNN {version} (<= 9.15.0) TE refuses fused "
            f"attention under graph capture for a KV length that is not a multiple of 128 ({lengths}) and {effect}: "
            f"set model.text_tokens={text_tokens} ({fixed} decoder tokens{' as padded' if factor > 1 else ''}), "
            "graph no attention "
            "(cuda_graph=none), or upgrade cuDNN to 9.15.1+")


# --- memory ------------------------------------------------------------------------------------------------

@rule
def fits_in_gpu_memory(cfg: RunConfig) -> Optional[str]:
    if cfg.hardware.device != "cuda":
        return None
    est = estimate(cfg)
    if est.total_gib > cfg.hardware.memory_gib:
        return (f"needs at least {est.total_gib:.1f} GiB per GPU ({est.static_gib:.1f} weights, gradients and "
                f"optimizer states + {est.activations_gib:.1f} activations; plan/memory.py), more than "
                f"hardware.memory_gib={cfg.hardware.memory_gib}: shard further (parallel.tp/pp/ep, more GPUs, "
                "parallel=fsdp), lower batch.mbs or use recompute=full")


# --- MoE dispatcher ----------------------------------------------------------------------------------------

@rule
def flex_needs_backend(cfg: RunConfig) -> Optional[str]:
    d = cfg.dispatcher
    if d.token_dispatcher == "flex" and d.flex_backend is None:
        return "dispatcher.token_dispatcher=flex needs dispatcher.flex_backend (deepep|hybridep)"
    if d.token_dispatcher != "flex" and d.flex_backend is not None:
        return f"dispatcher.flex_backend={d.flex_backend} applies to the flex dispatcher only, not {d.token_dispatcher}"


@rule
def flex_needs_gpu(cfg: RunConfig) -> Optional[str]:
    if cfg.dispatcher.token_dispatcher == "flex" and cfg.hardware.device == "cpu":
        return f"dispatcher={cfg.dispatcher.name} runs DeepEP CUDA kernels; it needs GPU hardware, not hardware=cpu"


@rule
def deepep_needs_model_parallel(cfg: RunConfig) -> Optional[str]:
    d, p = cfg.dispatcher, cfg.parallel
    if d.flex_backend == "deepep" and p.tp * p.ep == 1:
        return f"dispatcher=flex_deepep needs parallel.tp*ep > 1 (got tp={p.tp}, ep={p.ep})"


@rule
def pad_needs_capacity(cfg: RunConfig) -> Optional[str]:
    d = cfg.dispatcher
    if d.pad_to_capacity and d.capacity_factor is None:
        return "dispatcher.pad_to_capacity=true needs dispatcher.capacity_factor"


# --- packed sequences --------------------------------------------------------------------------------------

@rule
def packing_excludes_cuda_graphs(cfg: RunConfig) -> Optional[str]:
    if cfg.data.packing and cfg.cuda_graph.impl != "none":
        return (f"data.packing=true with cuda_graph={cfg.cuda_graph.scope}: a graph replays the shapes it "
                "captured, and a packed micro-batch's length is its samples' real tokens, new every micro-batch")


@rule
def packing_needs_unsharded_sequence(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if cfg.data.packing and (p.sp or p.cp > 1):
        return (f"data.packing=true with parallel.sp={str(p.sp).lower()} cp={p.cp}: under SP or CP LLaVA pads "
                "the packed row back to its longest length, and CP needs per-shard padded cu_seqlens, which "
                "this worker does not build; use tp=1 (MoE with tp > 1 needs SP) and cp=1")


@rule
def packing_on_local_specs_needs_unfused_softmax(cfg: RunConfig) -> Optional[str]:
    if (cfg.data.packing and not _uses_te(cfg)
            and cfg.fusions.resolved(on_gpu=cfg.hardware.device == "cuda")["masked_softmax"]):
        return ("data.packing=true with train.transformer_impl=local needs fusions.masked_softmax=false: the "
                "local attention keeps samples apart with a block-causal mask, and megatron's fused causal "
                "softmax (ScaledUpperTriangMaskedSoftmax) ignores the mask, so samples would attend to each other")


@rule
def packing_needs_one_stage(cfg: RunConfig) -> Optional[str]:
    if cfg.data.packing and cfg.parallel.pp > 1:
        return (f"data.packing=true with parallel.pp={cfg.parallel.pp}: the pipeline's send and receive buffers "
                "are shaped for seq_length x mbs, and a packed micro-batch's length changes every micro-batch")


@rule
def overlap_param_gather_needs_grad_overlap(cfg: RunConfig) -> Optional[str]:
    p = cfg.parallel
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        return ("parallel.overlap_param_gather=true needs parallel.overlap_grad_reduce=true (Megatron-LM's "
                "arguments.py: 'Must use --overlap-param-gather with --overlap-grad-reduce')")


CUDNN_THD = {True: 90600, False: 90100}
"""The cuDNN runtime from which TE's fused attention takes THD rows on sm90, with GQA (True) or without: below it
TE 2.20 falls back to unfused attention, which pads the row back to [mbs, max_seqlen] and scores it whole."""


def packing_unfuses_attention(cfg: RunConfig, cudnn_version: int, flash_attn: bool = False) -> Optional[str]:
    """Not a registered rule: the worker's preflight passes the runtime cuDNN and whether flash-attn (whose varlen
    kernels take THD too) is installed. A packed run on an unfused fallback would measure the fallback, not
    packing, and may not fit: at MBS 96 the scores alone take gigabytes per layer."""
    d = cfg.model.decoder
    gqa = d.num_query_groups < d.num_attention_heads
    needed = CUDNN_THD[gqa]
    if not cfg.data.packing or not _uses_te(cfg) or flash_attn or cudnn_version >= needed:
        return None
    return (f"data.packing=true runs THD attention, which TE's fused attention takes from cuDNN {_cudnn(needed)}"
            f"{' with GQA' if gqa else ''}; with cuDNN {_cudnn(cudnn_version)} TE falls back to unfused attention "
            "over the row padded back to [mbs, max_seqlen]: upgrade cuDNN, install flash-attn, or data.packing=false")
