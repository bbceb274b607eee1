"""Every cross-field rule a run must satisfy before it may cost a process, in one module: the rule table.

Each rule is a small function of the whole ``RunConfig`` returning a message (knob, value, rule) or None, registered
with the class of its reason (:class:`Basis`). A rule that mirrors a check megatron-core 0.19.2 makes names that
check's file and condition, appended to its message, so a user can look it up; every other rule says why
megatron-core would not refuse the config itself (memory, the machine or the run, the LLaVA model as it is built, or
a knob megatron would silently ignore). ``tests/test_rules_vs_megatron.py`` holds the table against megatron-core's
own checks on random configs. Rules are pure: what depends on the machine (TE or DeepEP installed, GPUs present,
the cuDNN version) is the worker's preflight (``train/preflight.py``), its rules in ``train/machine_rules.py``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass

from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.plan.layout import sharded_seq_length
from moe_vlm_sweep.plan.memory import estimate

Check = Callable[[RunConfig], str | None]


class Basis(enum.Enum):
    """Why a rule refuses, held against megatron-core's own verdict on the same config."""

    MEGATRON = "megatron-core refuses it"
    """A check megatron-core makes before a model runs (``TransformerConfig``, ``parallel_state``, the micro-batch
    calculator, the pipeline schedule, the token dispatcher's constructor); ``source`` names it."""
    MODEL_BUILD = "LLaVA model construction"
    """megatron-core refuses it while it builds the LLaVA model and its layers (``source`` names the check); the
    differential test runs LLaVA's own constructor checks for local specs, not the layers'."""
    MEMORY = "memory"
    """megatron-core would start it; it cannot fit the GPU (``plan/memory.py``)."""
    RUNTIME = "machine/runtime"
    """megatron-core would start it, but the machine lacks what it needs, or the run fails or measures something
    else while it runs (graph capture, a host sync, what this worker does)."""
    IGNORED = "knob megatron would silently ignore"
    """megatron-core would run it with the knob doing nothing, so the run would not measure what was asked."""


@dataclass(frozen=True)
class Rule:
    check: Check
    basis: Basis
    source: str | None = None
    """megatron-core's own check, as ``file: condition``, where the rule mirrors one."""

    @property
    def name(self) -> str:
        return self.check.__name__

    def __call__(self, cfg: RunConfig) -> str | None:
        message = self.check(cfg)
        return f"{message} ({self.source})" if message and self.source else message


RULES: list[Rule] = []


class ConfigError(ValueError):
    """A config breaks one or more rules; the message lists each, naming knob, value and rule."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in self.problems))


def rule(basis: Basis, source: str | None = None) -> Callable[[Check], Check]:
    """Register a check in the table with the class of its reason and, where megatron-core makes the same check,
    where (``megatron/core/<file>.py: <condition>``)."""
    if basis in (Basis.MEGATRON, Basis.MODEL_BUILD) and not source:
        raise ValueError(f"a {basis.name} rule names megatron-core's check (source)")

    def register(fn: Check) -> Check:
        RULES.append(Rule(fn, basis, source))
        return fn

    return register


def broken(cfg: RunConfig) -> list[tuple[Rule, str]]:
    """Each rule ``cfg`` breaks, with its message."""
    return [(r, msg) for r in RULES if (msg := r(cfg))]


def broken_rules(cfg: RunConfig) -> list[str]:
    return [msg for _, msg in broken(cfg)]


def _world(cfg: RunConfig) -> int:
    return cfg.launcher.world_size


def _dp(cfg: RunConfig) -> int:
    p = cfg.parallel
    return _world(cfg) // (p.tp * p.pp * p.cp)


def uses_te(cfg: RunConfig) -> bool:
    return cfg.train.resolved_transformer_impl(cfg.hardware.device) == "transformer_engine"


def _all_layers_moe(cfg: RunConfig) -> bool:
    return cfg.model.decoder.moe_layer_freq == 1


def _drop_and_pad(cfg: RunConfig) -> bool:
    return cfg.dispatcher.capacity_factor is not None and cfg.dispatcher.pad_to_capacity


def _deepep(cfg: RunConfig) -> bool:
    return cfg.dispatcher.token_dispatcher == "flex" and cfg.dispatcher.flex_backend == "deepep"


TC = "megatron/core/transformer/transformer_config.py"
PS = "megatron/core/parallel_state.py"
LLAVA = "megatron/core/models/multimodal/llava_model.py"


# --- launcher and hardware ---------------------------------------------------------------------------------


@rule(Basis.RUNTIME)
def local_launcher_is_one_process(cfg: RunConfig) -> str | None:
    if cfg.launcher.name == "local" and _world(cfg) != 1:
        return (
            f"launcher.nproc_per_node={cfg.launcher.nproc_per_node} with launcher.nnodes={cfg.launcher.nnodes}: "
            "launcher=local runs one process; use launcher=torchrun for a world size > 1"
        )
    return None


@rule(Basis.RUNTIME)
def processes_fit_the_node(cfg: RunConfig) -> str | None:
    if cfg.launcher.nproc_per_node > cfg.hardware.gpus_per_node:
        return (
            f"launcher.nproc_per_node={cfg.launcher.nproc_per_node} must be <= "
            f"hardware.gpus_per_node={cfg.hardware.gpus_per_node} (hardware={cfg.hardware.name})"
        )
    return None


@rule(Basis.RUNTIME)
def te_needs_gpu(cfg: RunConfig) -> str | None:
    if cfg.hardware.device == "cpu" and cfg.train.transformer_impl == "transformer_engine":
        return "train.transformer_impl=transformer_engine needs GPU hardware, not hardware=cpu"
    return None


@rule(Basis.RUNTIME)
def cuda_graphs_need_gpu(cfg: RunConfig) -> str | None:
    if cfg.hardware.device == "cpu" and cfg.cuda_graph.impl != "none":
        return f"cuda_graph.impl={cfg.cuda_graph.impl} needs GPU hardware, not hardware=cpu"
    return None


@rule(Basis.RUNTIME)
def fusions_need_gpu(cfg: RunConfig) -> str | None:
    if cfg.hardware.device == "cpu":
        on = [name for name in cfg.fusions.GPU_ONLY if getattr(cfg.fusions, name)]
        if on:
            return f"fusions.{on[0]}=true needs GPU hardware (CUDA kernels), not hardware=cpu"
    return None


@rule(Basis.IGNORED)
def allocator_setting_needs_gpu(cfg: RunConfig) -> str | None:
    if cfg.hardware.device == "cpu" and cfg.train.expandable_segments:
        return (
            "train.expandable_segments=true configures the CUDA caching allocator; it needs GPU hardware, "
            "not hardware=cpu"
        )
    return None


# --- layout ------------------------------------------------------------------------------------------------


@rule(Basis.MEGATRON, f"{PS}: world_size % (tensor * pipeline * context parallel size) == 0")
def dense_layout_divides_world(cfg: RunConfig) -> str | None:
    p = cfg.parallel
    if _world(cfg) % (p.tp * p.pp * p.cp):
        return (
            f"parallel.tp*pp*cp={p.tp}*{p.pp}*{p.cp}={p.tp * p.pp * p.cp} must divide the world size "
            f"{_world(cfg)} (launcher.nproc_per_node * launcher.nnodes)"
        )
    return None


@rule(Basis.MEGATRON, f"{PS}: world_size % (expert tensor * expert * pipeline parallel size) == 0")
def expert_layout_divides_world(cfg: RunConfig) -> str | None:
    p = cfg.parallel
    if _world(cfg) % (p.etp * p.ep * p.pp):
        return (
            f"parallel.etp*ep*pp={p.etp}*{p.ep}*{p.pp}={p.etp * p.ep * p.pp} must divide the world size {_world(cfg)}"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: num_attention_heads % tensor_model_parallel_size == 0")
def tp_divides_heads(cfg: RunConfig) -> str | None:
    d = cfg.model.decoder
    if d.num_attention_heads % cfg.parallel.tp:
        return f"parallel.tp={cfg.parallel.tp} must divide model.decoder.num_attention_heads={d.num_attention_heads}"
    return None


@rule(
    Basis.MEGATRON,
    f"{TC}: num_query_groups % tensor_model_parallel_size == 0 or tensor_model_parallel_size % num_query_groups == 0",
)
def tp_and_query_groups_divide(cfg: RunConfig) -> str | None:
    """With fewer KV groups than TP ranks megatron-core replicates each KV head over tp / groups ranks."""
    d, tp = cfg.model.decoder, cfg.parallel.tp
    if d.num_query_groups % tp and tp % d.num_query_groups:
        return (
            f"parallel.tp={tp} must be a multiple or a divisor of model.decoder.num_query_groups={d.num_query_groups}"
        )
    return None


@rule(
    Basis.MODEL_BUILD,
    "megatron/core/tensor_parallel/layers.py: ColumnParallelLinear, divide(output_size, world_size) for linear_qkv",
)
def tp_divides_fused_qkv(cfg: RunConfig) -> str | None:
    """The fused QKV projection is one column-parallel linear of head_dim * (heads + 2 groups) outputs; with as
    many groups as TP ranks or more the head rules already divide it, with fewer they may not."""
    d, tp = cfg.model.decoder, cfg.parallel.tp
    width = d.head_dim * (d.num_attention_heads + 2 * d.num_query_groups)
    if d.num_query_groups < tp and width % tp:
        return (
            f"parallel.tp={tp} must divide the fused QKV width {width} (model.decoder head_dim {d.head_dim} x "
            f"(num_attention_heads {d.num_attention_heads} + 2 x num_query_groups {d.num_query_groups}))"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: num_attention_heads % tensor_model_parallel_size == 0, vision config")
def tp_divides_vision_heads(cfg: RunConfig) -> str | None:
    v = cfg.model.vision
    if v.num_attention_heads % cfg.parallel.tp:
        return (
            f"parallel.tp={cfg.parallel.tp} must divide model.vision.num_attention_heads={v.num_attention_heads} "
            "(the ViT runs with the decoder's TP)"
        )
    return None


@rule(
    Basis.MEGATRON,
    "megatron/core/transformer/transformer_block.py: get_num_layers_to_build, num_layers % "
    "pipeline_model_parallel_size == 0 and layers per rank % vp_size == 0",
)
def pp_divides_layers(cfg: RunConfig) -> str | None:
    p, layers = cfg.parallel, cfg.model.decoder.num_layers
    if layers % (p.pp * p.vpp):
        return (
            f"parallel.pp*vpp={p.pp}*{p.vpp} must divide model.decoder.num_layers={layers} "
            "(every pipeline chunk holds the same number of layers)"
        )
    return None


@rule(Basis.MEGATRON, f"{PS}: pipeline-model-parallel size should be greater than 1 with interleaved schedule")
def vpp_needs_pp(cfg: RunConfig) -> str | None:
    if cfg.parallel.vpp > 1 and cfg.parallel.pp == 1:
        return f"parallel.vpp={cfg.parallel.vpp} needs parallel.pp > 1 (interleaving splits pipeline stages)"
    return None


@rule(Basis.MODEL_BUILD, "megatron/core/transformer/moe/moe_layer.py: num_moe_experts % ep_size == 0")
def ep_divides_experts(cfg: RunConfig) -> str | None:
    if cfg.model.decoder.num_experts % cfg.parallel.ep:
        return f"parallel.ep={cfg.parallel.ep} must divide model.decoder.num_experts={cfg.model.decoder.num_experts}"
    return None


@rule(
    Basis.MODEL_BUILD,
    "megatron/core/tensor_parallel/layers.py: the experts' ColumnParallelLinear, "
    "divide(moe_ffn_hidden_size, expert tensor parallel size)",
)
def etp_divides_expert_ffn(cfg: RunConfig) -> str | None:
    d = cfg.model.decoder
    if d.moe_ffn_hidden_size % cfg.parallel.etp:
        return f"parallel.etp={cfg.parallel.etp} must divide model.decoder.moe_ffn_hidden_size={d.moe_ffn_hidden_size}"
    return None


@rule(
    Basis.MEGATRON, "megatron/core/model_parallel_config.py: Cannot use sequence parallelism without tensor parallelism"
)
def sp_needs_tp(cfg: RunConfig) -> str | None:
    if cfg.parallel.sp and cfg.parallel.tp == 1:
        return "parallel.sp=true needs parallel.tp > 1 (sequence parallel splits along the TP group)"
    return None


@rule(
    Basis.RUNTIME,
    "megatron/core/transformer/moe/moe_layer.py: forward raises when training with a TP group > 1 "
    "and not sequence_parallel",
)
def moe_with_tp_needs_sp(cfg: RunConfig) -> str | None:
    if cfg.parallel.tp > 1 and not cfg.parallel.sp:
        return (
            f"parallel.tp={cfg.parallel.tp} with MoE layers needs parallel.sp=true "
            "(megatron-core's MoE layer raises during training otherwise)"
        )
    return None


@rule(
    Basis.MODEL_BUILD,
    f"{LLAVA}: under SP or CP, language_transformer_layer_spec.submodules must be TransformerLayerSubmodules",
)
def sp_needs_uniform_layers(cfg: RunConfig) -> str | None:
    freq = cfg.model.decoder.moe_layer_freq
    if (cfg.parallel.sp or cfg.parallel.cp > 1) and freq > 1:
        return (
            f"model.decoder.moe_layer_freq={freq} with parallel.sp/cp: megatron-core's LLaVA checks a single "
            "layer spec under sequence or context parallelism, and mixed dense/MoE layers need a block spec"
        )
    return None


@rule(Basis.MODEL_BUILD, f"{LLAVA}: Sequence/Context Parallelism is supported only with TE DotProductAttention")
def cp_needs_te(cfg: RunConfig) -> str | None:
    """LLaVA pads the decoder sequence to a multiple of 2*cp itself (``plan/layout.py``), so any length splits;
    what CP needs is TE's attention."""
    if cfg.parallel.cp > 1 and not uses_te(cfg):
        return (
            f"parallel.cp={cfg.parallel.cp} needs Transformer Engine attention "
            "(megatron-core's local DotProductAttention supports cp=1 only)"
        )
    return None


@rule(Basis.MODEL_BUILD, f"{LLAVA}: Sequence/Context Parallelism is supported only with TE DotProductAttention")
def sp_on_gpu_needs_te(cfg: RunConfig) -> str | None:
    """On the CPU the worker lifts LLaVA's assert (``train/cpu_compat.py``, patch 11: the sequence is padded to a
    multiple of TP, so the local causal attention is exact); on a GPU megatron-core's assert stands."""
    if cfg.parallel.sp and cfg.hardware.device == "cuda" and not uses_te(cfg):
        return (
            "parallel.sp=true on GPU hardware needs train.transformer_impl=transformer_engine: LLaVA "
            "supports sequence parallelism only with TE attention"
        )
    return None


@rule(Basis.RUNTIME)
def fsdp_has_no_pipeline(cfg: RunConfig) -> str | None:
    if cfg.parallel.strategy == "fsdp" and cfg.parallel.pp > 1:
        return f"parallel.pp={cfg.parallel.pp} with parallel=fsdp: Megatron-FSDP does not pipeline; use parallel=3d"
    return None


@rule(
    Basis.MEGATRON,
    "megatron/core/num_microbatches_calculator.py: global_batch_size % (micro_batch_size * data_parallel_size) == 0",
)
def gbs_divisible_by_mbs_dp(cfg: RunConfig) -> str | None:
    b, dp = cfg.batch, _dp(cfg)
    if dp >= 1 and b.gbs % (b.mbs * dp):
        return f"batch.gbs={b.gbs} must be divisible by batch.mbs*dp={b.mbs}*{dp}={b.mbs * dp}"
    return None


@rule(
    Basis.MEGATRON,
    "megatron/core/pipeline_parallel/schedules.py: forward_backward_pipelining_with_interleaving, "
    "microbatch_group_size_per_vp_stage (= pp) <= num_microbatches and num_microbatches % it "
    "not in (0, pp)",
)
def interleaving_needs_whole_microbatch_groups(cfg: RunConfig) -> str | None:
    """The interleaved schedule runs micro-batches in groups of pp per model chunk, and raises at the first step
    if there are fewer than pp or the last group is short."""
    b, p, dp = cfg.batch, cfg.parallel, _dp(cfg)
    if p.vpp == 1 or p.pp == 1 or dp < 1 or b.gbs % (b.mbs * dp):
        return None
    microbatches = b.gbs // (b.mbs * dp)
    if microbatches < p.pp or microbatches % p.pp:
        return (
            f"parallel.vpp={p.vpp} interleaves the pipeline, which needs the micro-batches per step "
            f"(batch.gbs / (batch.mbs * dp) = {b.gbs} / ({b.mbs} * {dp}) = {microbatches}) to be a multiple "
            f"of parallel.pp={p.pp}"
        )
    return None


# --- model shape -------------------------------------------------------------------------------------------


@rule(Basis.MODEL_BUILD, f"{LLAVA}: pixel_shuffle, h*w must equal the patches")
def spatial_merge_needs_even_grid(cfg: RunConfig) -> str | None:
    v = cfg.model.vision
    grid = v.image_size // v.patch_size
    if v.spatial_merge > 1 and grid % v.spatial_merge:
        return (
            f"model.vision.spatial_merge={v.spatial_merge} must divide the patch grid side {grid} "
            f"(model.vision.image_size / model.vision.patch_size)"
        )
    return None


# --- recompute ---------------------------------------------------------------------------------------------


@rule(Basis.IGNORED)
def selective_needs_modules(cfg: RunConfig) -> str | None:
    r = cfg.recompute
    if r.granularity == "selective" and not r.modules:
        return "recompute.modules=[] with recompute=selective: name at least one module (e.g. core_attn)"
    if r.granularity != "selective" and r.modules:
        return f"recompute.modules={r.modules} applies to recompute=selective only, not {r.granularity}"
    return None


@rule(Basis.MEGATRON, f'{TC}: recompute_method must be "block" or "uniform" with recompute_granularity full')
def full_recompute_needs_method(cfg: RunConfig) -> str | None:
    r = cfg.recompute
    if r.granularity == "full" and r.method is None:
        return "recompute=full needs recompute.method (uniform|block)"
    return None


@rule(Basis.IGNORED)
def full_recompute_fields(cfg: RunConfig) -> str | None:
    """The plan-to-config mapping passes recompute.method/num_layers for recompute=full only, and would default a
    missing num_layers."""
    r = cfg.recompute
    if r.granularity == "full" and r.num_layers is None:
        return "recompute=full needs recompute.num_layers"
    if r.granularity != "full" and (r.method is not None or r.num_layers is not None):
        return f"recompute.method/recompute.num_layers apply to recompute=full only, not {r.granularity}"
    return None


@rule(Basis.IGNORED)
def recompute_layers_fit_stage(cfg: RunConfig) -> str | None:
    r, p = cfg.recompute, cfg.parallel
    per_chunk = cfg.model.decoder.num_layers // (p.pp * p.vpp)
    if r.granularity == "full" and r.num_layers is not None and r.num_layers > per_chunk:
        return f"recompute.num_layers={r.num_layers} must be <= the {per_chunk} decoder layers of one pipeline chunk"
    return None


@rule(Basis.MEGATRON, f"{TC}: moe_act in recompute_modules is only supported with moe_grouped_gemm")
def moe_act_recompute_needs_te(cfg: RunConfig) -> str | None:
    if "moe_act" in cfg.recompute.modules and not uses_te(cfg):
        return (
            "recompute.modules contains moe_act, which needs TE grouped GEMM "
            "(train.transformer_impl=transformer_engine)"
        )
    return None


@rule(Basis.IGNORED)
def mla_recompute_needs_mla(cfg: RunConfig) -> str | None:
    if "mla_up_proj" in cfg.recompute.modules:
        return "recompute.modules contains mla_up_proj, which needs multi-latent attention; these models use GQA"
    return None


@rule(Basis.IGNORED)
def mlp_recompute_needs_dense_layers(cfg: RunConfig) -> str | None:
    if "mlp" in cfg.recompute.modules and _all_layers_moe(cfg):
        return (
            "recompute.modules contains mlp, which recomputes dense MLPs; every layer is MoE "
            "(model.decoder.moe_layer_freq=1): use moe or moe_act"
        )
    return None


@rule(Basis.IGNORED)
def shared_expert_recompute_needs_shared_experts(cfg: RunConfig) -> str | None:
    if "shared_experts" in cfg.recompute.modules and not cfg.model.decoder.moe_shared_expert_intermediate_size:
        return (
            "recompute.modules contains shared_experts, but "
            "model.decoder.moe_shared_expert_intermediate_size is not set"
        )
    return None


# --- CUDA graphs -------------------------------------------------------------------------------------------


@rule(Basis.IGNORED)
def graph_modules_need_impl(cfg: RunConfig) -> str | None:
    g = cfg.cuda_graph
    if g.impl == "none" and g.modules:
        return f"cuda_graph.modules={g.modules} needs cuda_graph.impl local or transformer_engine, not none"
    return None


@rule(Basis.MEGATRON, f'{TC}: cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"')
def full_iteration_takes_no_modules(cfg: RunConfig) -> str | None:
    g = cfg.cuda_graph
    if g.impl == "full_iteration" and g.modules:
        return f"cuda_graph.modules={g.modules} must be empty with cuda_graph.impl=full_iteration"
    return None


@rule(Basis.RUNTIME)
def full_iteration_cannot_capture_llava(cfg: RunConfig) -> str | None:
    if cfg.cuda_graph.impl == "full_iteration":
        return (
            "cuda_graph.impl=full_iteration cannot capture LLaVAModel: its _preprocess_data calls .tolist() "
            "(a host sync) inside the step; use cuda_graph=attn or a layer scope"
        )
    return None


def _graphed_modules(cfg: RunConfig) -> set[str]:
    """The per-layer graph scopes as megatron-core's config sees them: none unless a per-layer impl graphs them,
    and the local impl, which cannot graph the router and its preprocess apart, takes either as both."""
    g = cfg.cuda_graph
    if g.impl not in ("local", "transformer_engine"):
        return set()
    modules: set[str] = {str(m) for m in g.modules}
    if g.impl == "local" and modules & {"moe_router", "moe_preprocess"}:
        modules |= {"moe_router", "moe_preprocess"}
    return modules


@rule(
    Basis.MEGATRON,
    f"{TC}: cuda_graph_modules must not contain both moe and moe_router (the local impl adds "
    "moe_router to moe_preprocess)",
)
def graph_moe_scopes_exclusive(cfg: RunConfig) -> str | None:
    if {"moe", "moe_router"} <= _graphed_modules(cfg):
        also = (
            " (cuda_graph.impl=local graphs moe_preprocess with moe_router)"
            if "moe_router" not in cfg.cuda_graph.modules
            else ""
        )
        return (
            f"cuda_graph.modules contains both moe and moe_router{also}; they are exclusive (moe graphs the router too)"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: moe_preprocess cuda graph is only supported with moe_router cuda graph")
def graph_preprocess_needs_router(cfg: RunConfig) -> str | None:
    if "moe_preprocess" in _graphed_modules(cfg) and "moe_router" not in _graphed_modules(cfg):
        return "cuda_graph.modules contains moe_preprocess, which needs moe_router as well"
    return None


@rule(Basis.MEGATRON, f"{TC}: mlp cuda graph is only supported for dense layers")
def graph_mlp_needs_dense_layers(cfg: RunConfig) -> str | None:
    if "mlp" in _graphed_modules(cfg) and _all_layers_moe(cfg):
        return "cuda_graph.modules contains mlp, but every layer is MoE (model.decoder.moe_layer_freq=1): use moe"
    return None


@rule(Basis.IGNORED)
def graph_mamba_needs_mamba(cfg: RunConfig) -> str | None:
    if "mamba" in cfg.cuda_graph.modules:
        return "cuda_graph.modules contains mamba, but these decoders have no Mamba layers"
    return None


def _pad_fix(cfg: RunConfig) -> str:
    return "dispatcher=flex_deepep cannot pad: use dispatcher=alltoall or allgather with " if _deepep(cfg) else "set "


@rule(Basis.MEGATRON, f"{TC}: moe cuda graph is only supported with drop-padding MoE")
def graph_moe_needs_drop_and_pad(cfg: RunConfig) -> str | None:
    if "moe" in _graphed_modules(cfg) and not _drop_and_pad(cfg):
        return (
            f"cuda_graph.modules contains moe, which needs drop-and-pad (static shapes): {_pad_fix(cfg)}"
            "dispatcher.capacity_factor and dispatcher.pad_to_capacity=true"
        )
    return None


@rule(Basis.RUNTIME)
def whole_layer_graphs_need_drop_and_pad(cfg: RunConfig) -> str | None:
    """megatron-core's config check looks at the moe scope only; a TE graph of whole layers captures the experts
    and the dispatcher too, whose dropless token counts change every step."""
    g = cfg.cuda_graph
    if g.impl == "transformer_engine" and not g.modules and not _drop_and_pad(cfg):
        return (
            "cuda_graph.modules is empty (whole layers, experts included), which needs drop-and-pad (static "
            f"shapes): {_pad_fix(cfg)}dispatcher.capacity_factor and dispatcher.pad_to_capacity=true"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: moe_preprocess cuda graph with alltoall and a capacity factor but no padding")
def graph_preprocess_vs_alltoall_capacity(cfg: RunConfig) -> str | None:
    d = cfg.dispatcher
    if (
        "moe_preprocess" in _graphed_modules(cfg)
        and d.token_dispatcher == "alltoall"
        and d.capacity_factor is not None
        and not d.pad_to_capacity
    ):
        return (
            f"cuda_graph.modules contains moe_preprocess, which megatron-core rejects for dispatcher=alltoall "
            f"with dispatcher.capacity_factor={d.capacity_factor} unless dispatcher.pad_to_capacity=true "
            "(dropping without padding syncs the host in the preprocess step)"
        )
    return None


@rule(Basis.RUNTIME)
def local_graphs_need_drop_and_pad(cfg: RunConfig) -> str | None:
    if cfg.cuda_graph.impl == "local" and not _drop_and_pad(cfg):
        return (
            "cuda_graph.impl=local cannot capture dropless MoE (cudaErrorCapturedEvent in the dispatcher): "
            f"{_pad_fix(cfg)}dispatcher.capacity_factor and dispatcher.pad_to_capacity=true"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: full recompute is only supported with full iteration CUDA graph")
def full_recompute_only_with_full_iteration(cfg: RunConfig) -> str | None:
    if cfg.recompute.granularity == "full" and cfg.cuda_graph.impl in ("local", "transformer_engine"):
        return (
            f"recompute=full with cuda_graph.impl={cfg.cuda_graph.impl}: megatron-core allows full recompute "
            "only with full_iteration graphs; use recompute=selective or cuda_graph=none"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: moe recompute is not supported with moe_router CUDA graph with transformer_engine")
def moe_recompute_excludes_router_graph(cfg: RunConfig) -> str | None:
    if (
        cfg.cuda_graph.impl == "transformer_engine"
        and "moe" in cfg.recompute.modules
        and "moe_router" in cfg.cuda_graph.modules
    ):
        return (
            "recompute.modules contains moe while cuda_graph.modules contains moe_router: a recomputed MoE "
            "block cannot hold a TE-graphed router"
        )
    return None


@rule(Basis.RUNTIME)
def graph_warmup_within_warmup(cfg: RunConfig) -> str | None:
    g, t = cfg.cuda_graph, cfg.train
    if g.impl == "transformer_engine" and g.warmup_steps >= t.warmup_steps:
        return (
            f"cuda_graph.warmup_steps={g.warmup_steps} must be < train.warmup_steps={t.warmup_steps}: TE "
            "graphs are captured after cuda_graph.warmup_steps eager steps, and at least one graphed warmup "
            "step must follow before the timed steps"
        )
    return None


@rule(Basis.IGNORED)
def trace_needs_profile_steps(cfg: RunConfig) -> str | None:
    if cfg.train.trace and cfg.train.profile_steps == 0:
        return "train.trace=true traces the profile steps, but train.profile_steps=0: set it to 1 or more"
    return None


@rule(Basis.RUNTIME)
def layer_graphs_vs_fsdp(cfg: RunConfig) -> str | None:
    impl, p = cfg.cuda_graph.impl, cfg.parallel
    if p.strategy != "fsdp":
        return None
    if impl == "transformer_engine":
        return (
            "cuda_graph.impl=transformer_engine with parallel=fsdp: TE make_graphed_callables refuses modules "
            "with hooks, and Megatron-FSDP registers them on every layer (seen on the H200); use parallel=3d"
        )
    if impl == "local" and p.fsdp_sharding == "optim_grads_params":
        return (
            "cuda_graph.impl=local with parallel.fsdp_sharding=optim_grads_params: Megatron-FSDP gathers each "
            "layer's parameters in forward hooks that a graph replay skips; use parallel=3d"
        )
    return None


@rule(Basis.RUNTIME)
def te_graphs_need_te_specs(cfg: RunConfig) -> str | None:
    if cfg.cuda_graph.impl == "transformer_engine" and cfg.hardware.device == "cuda" and not uses_te(cfg):
        return (
            "cuda_graph.impl=transformer_engine captures through TE make_graphed_callables, which needs "
            "train.transformer_impl=transformer_engine (the local specs are graphed by cuda_graph=layer_local)"
        )
    return None


# --- precision ---------------------------------------------------------------------------------------------


def _fp8(cfg: RunConfig) -> bool:
    return cfg.train.precision == "fp8"


@rule(Basis.RUNTIME)
def fp8_needs_fp8_hardware(cfg: RunConfig) -> str | None:
    if _fp8(cfg) and not cfg.hardware.fp8:
        return (
            "train.precision=fp8 needs GPU hardware with FP8 GEMMs (Hopper or later), but "
            f"hardware={cfg.hardware.name} has hardware.fp8=false"
        )
    return None


@rule(Basis.IGNORED)
def fp8_needs_te_specs(cfg: RunConfig) -> str | None:
    """megatron enters TE's fp8_autocast around the decoder layers whatever their specs; only TE modules read it."""
    if _fp8(cfg) and cfg.hardware.device == "cuda" and not uses_te(cfg):
        return (
            "train.precision=fp8 runs the decoder's Transformer Engine GEMMs in FP8; with "
            "train.transformer_impl=local no layer is TE's and the run would train in bf16"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: Delayed scaling does not support moe_act and layernorm recompute for fp8")
def fp8_delayed_excludes_moe_act_recompute(cfg: RunConfig) -> str | None:
    modules = sorted({"moe_act", "layernorm"} & set(cfg.recompute.modules))
    if _fp8(cfg) and cfg.train.fp8_recipe == "delayed" and modules and cfg.recompute.granularity == "selective":
        return (
            f"recompute.modules contains {' and '.join(modules)}, which train.fp8_recipe=delayed cannot recompute: "
            "use train.fp8_recipe=tensorwise or blockwise, or drop them"
        )
    return None


@rule(Basis.RUNTIME)
def fp8_excludes_packing(cfg: RunConfig) -> str | None:
    if _fp8(cfg) and cfg.data.packing:
        return (
            "train.precision=fp8 with data.packing=true: a packed micro-batch holds its samples' real tokens, a "
            "count TE's FP8 GEMMs refuse unless it is a multiple of 8 (transformer_engine/pytorch/utils.py: "
            "assert_dim_for_fp8_exec), and it changes every micro-batch; use data.packing=false"
        )
    return None


def fp8_gemm_shapes(cfg: RunConfig) -> list[tuple[str, int, int]]:
    """Each FP8 GEMM of a decoder layer on one rank as TE checks it: (what, rows, inner width), the rows a multiple
    of 8 and the width of 16. The weights are [out, in] per rank; the input's rows are the micro-batch's tokens
    on the rank (a column-parallel layer checks its sequence shard under SP before gathering it)."""
    d, p, mbs = cfg.model.decoder, cfg.parallel, cfg.batch.mbs
    tp, etp = p.tp, p.etp
    tokens = sharded_seq_length(cfg) // p.cp // (tp if p.sp else 1) * mbs
    qkv = d.head_dim * (d.num_attention_heads + 2 * d.num_query_groups)
    attn = d.head_dim * d.num_attention_heads
    shapes = [
        ("the tokens of a micro-batch on a rank (batch.mbs x the sequence shard)", tokens, d.hidden_size),
        ("attention linear_qkv weight [qkv width / tp, hidden_size]", qkv // tp, d.hidden_size),
        ("attention linear_proj weight [hidden_size, heads x head_dim / tp]", d.hidden_size, attn // tp),
        (
            "expert linear_fc1 weight [2 x moe_ffn_hidden_size / etp, hidden_size]",
            2 * d.moe_ffn_hidden_size // etp,
            d.hidden_size,
        ),
        (
            "expert linear_fc2 weight [hidden_size, moe_ffn_hidden_size / etp]",
            d.hidden_size,
            d.moe_ffn_hidden_size // etp,
        ),
    ]
    if d.moe_layer_freq > 1:
        shapes += [
            (
                "dense linear_fc1 weight [2 x ffn_hidden_size / tp, hidden_size]",
                2 * d.ffn_hidden_size // tp,
                d.hidden_size,
            ),
            ("dense linear_fc2 weight [hidden_size, ffn_hidden_size / tp]", d.hidden_size, d.ffn_hidden_size // tp),
        ]
    if shared := d.moe_shared_expert_intermediate_size:
        shapes += [
            ("shared expert linear_fc1 weight [2 x shared width / tp, hidden_size]", 2 * shared // tp, d.hidden_size),
            ("shared expert linear_fc2 weight [hidden_size, shared width / tp]", d.hidden_size, shared // tp),
        ]
    return shapes


@rule(
    Basis.RUNTIME,
    "transformer_engine/pytorch/utils.py: assert_dim_for_fp8_exec, product of leading dims % 8 == 0 and last dim "
    "% 16 == 0, checked by TE's Linear and LayerNormLinear forward under fp8; blockwise also "
    "transformer_engine/common/gemm/cublaslt_gemm.cu: lda % 16 == 0 for NVTE_BLOCK_SCALING GEMMs",
)
def fp8_gemm_dims_align(cfg: RunConfig) -> str | None:
    """megatron-core builds the model and starts; TE raises in the first forward or backward. Block scaling asks
    16 of every GEMM dimension that becomes a reduction one: the tokens in the weight-gradient GEMM, the output
    width in the input-gradient GEMM. The experts' grouped GEMMs get their token counts padded by megatron
    (``Fp8Padding`` in ``transformer/moe/experts.py``, to ``fp8_utils.get_fp8_align_size``), not their widths."""
    if not _fp8(cfg):
        return None
    rows_align = 16 if cfg.train.fp8_recipe == "blockwise" else 8
    shapes = fp8_gemm_shapes(cfg)
    bad = [f"{what} is {rows} x {width}" for what, rows, width in shapes if rows % rows_align or width % 16]
    if not bad:
        return None
    tokens = shapes[0][1]
    hint = ""
    if tokens % rows_align:
        shard = tokens // cfg.batch.mbs
        hint = (
            f"; the {shard}-token sequence shard needs batch.mbs a multiple of "
            f"{rows_align // math.gcd(shard, rows_align)}, or a model.text_tokens that makes it a multiple of "
            f"{rows_align}"
        )
    return (
        f"train.precision=fp8 with train.fp8_recipe={cfg.train.fp8_recipe} needs each decoder GEMM's rows to be a "
        f"multiple of {rows_align} and its inner width of 16, but {'; '.join(bad)}{hint}"
    )


# --- memory ------------------------------------------------------------------------------------------------


@rule(Basis.MEMORY)
def fits_in_gpu_memory(cfg: RunConfig) -> str | None:
    if cfg.hardware.device != "cuda":
        return None
    est = estimate(cfg)
    if est.total_gib > cfg.hardware.memory_gib:
        return (
            f"needs at least {est.total_gib:.1f} GiB per GPU ({est.static_gib:.1f} weights, gradients and "
            f"optimizer states + {est.activations_gib:.1f} activations; plan/memory.py), more than "
            f"hardware.memory_gib={cfg.hardware.memory_gib}: shard further (parallel.tp/pp/ep, more GPUs, "
            "parallel=fsdp), lower batch.mbs or use recompute=full"
        )
    return None


# --- MoE dispatcher ----------------------------------------------------------------------------------------


@rule(Basis.IGNORED)
def flex_needs_backend(cfg: RunConfig) -> str | None:
    d = cfg.dispatcher
    if d.token_dispatcher == "flex" and d.flex_backend is None:
        return "dispatcher.token_dispatcher=flex needs dispatcher.flex_backend (deepep|hybridep)"
    if d.token_dispatcher != "flex" and d.flex_backend is not None:
        return f"dispatcher.flex_backend={d.flex_backend} applies to the flex dispatcher only, not {d.token_dispatcher}"
    return None


@rule(Basis.RUNTIME)
def flex_needs_gpu(cfg: RunConfig) -> str | None:
    if cfg.dispatcher.token_dispatcher == "flex" and cfg.hardware.device == "cpu":
        return f"dispatcher={cfg.dispatcher.name} runs DeepEP CUDA kernels; it needs GPU hardware, not hardware=cpu"
    return None


@rule(
    Basis.MEGATRON,
    "megatron/core/transformer/moe/token_dispatcher.py: MoEFlexTokenDispatcher, DeepEP "
    "requires TPxEP > 1, over the expert tensor-parallel group",
)
def deepep_needs_model_parallel(cfg: RunConfig) -> str | None:
    """DeepEP dispatches over the expert group, expert-TP x EP: the dense TP does not count."""
    p = cfg.parallel
    if _deepep(cfg) and p.etp * p.ep == 1:
        return f"dispatcher=flex_deepep needs parallel.etp*ep > 1 (got etp={p.etp}, ep={p.ep})"
    return None


@rule(Basis.MEGATRON, f"{TC}: moe_pad_expert_input_to_capacity with the flex dispatcher's deepep backend")
def deepep_cannot_pad(cfg: RunConfig) -> str | None:
    if _deepep(cfg) and cfg.dispatcher.pad_to_capacity:
        return (
            "dispatcher.pad_to_capacity=true with dispatcher=flex_deepep: DeepEP does not pad expert inputs to "
            "capacity; use dispatcher=alltoall or allgather for drop-and-pad"
        )
    return None


@rule(Basis.MEGATRON, f"{TC}: moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity")
def pad_needs_capacity(cfg: RunConfig) -> str | None:
    d = cfg.dispatcher
    if d.pad_to_capacity and d.capacity_factor is None:
        return "dispatcher.pad_to_capacity=true needs dispatcher.capacity_factor"
    return None


# --- packed sequences --------------------------------------------------------------------------------------


@rule(Basis.RUNTIME)
def packing_excludes_cuda_graphs(cfg: RunConfig) -> str | None:
    if cfg.data.packing and cfg.cuda_graph.impl != "none":
        return (
            f"data.packing=true with cuda_graph={cfg.cuda_graph.scope}: a graph replays the shapes it "
            "captured, and a packed micro-batch's length is its samples' real tokens, new every micro-batch"
        )
    return None


@rule(Basis.RUNTIME)
def packing_needs_unsharded_sequence(cfg: RunConfig) -> str | None:
    p = cfg.parallel
    if cfg.data.packing and (p.sp or p.cp > 1):
        return (
            f"data.packing=true with parallel.sp={str(p.sp).lower()} cp={p.cp}: under SP or CP LLaVA pads "
            "the packed row back to its longest length, and CP needs per-shard padded cu_seqlens, which "
            "this worker does not build; use tp=1 (MoE with tp > 1 needs SP) and cp=1"
        )
    return None


@rule(Basis.RUNTIME)
def packing_on_local_specs_needs_unfused_softmax(cfg: RunConfig) -> str | None:
    if (
        cfg.data.packing
        and not uses_te(cfg)
        and cfg.fusions.resolved(on_gpu=cfg.hardware.device == "cuda")["masked_softmax"]
    ):
        return (
            "data.packing=true with train.transformer_impl=local needs fusions.masked_softmax=false: the "
            "local attention keeps samples apart with a block-causal mask, and megatron's fused causal "
            "softmax (ScaledUpperTriangMaskedSoftmax) ignores the mask, so samples would attend to each other"
        )
    return None


@rule(Basis.RUNTIME)
def packing_needs_one_stage(cfg: RunConfig) -> str | None:
    if cfg.data.packing and cfg.parallel.pp > 1:
        return (
            f"data.packing=true with parallel.pp={cfg.parallel.pp}: the pipeline's send and receive buffers "
            "are shaped for seq_length x mbs, and a packed micro-batch's length changes every micro-batch"
        )
    return None
