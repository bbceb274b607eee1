"""Every validation rule rejects a config that breaks it: exit 2, the knob named, nothing launched."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moe_vlm_sweep.cli import EXIT_INVALID, main
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.plan.rules import RULES, Basis
from moe_vlm_sweep.train.machine_rules import graphs_unfuse_attention, packing_unfuses_attention

T2 = ["launcher=torchrun", "launcher.nproc_per_node=2"]
GPU = ["hardware=h200"]
DROP_AND_PAD = ["dispatcher.capacity_factor=1.0", "dispatcher.pad_to_capacity=true"]

# rule name -> (overrides, text the error must contain)
CASES: dict[str, tuple[list[str], str]] = {
    "local_launcher_is_one_process": (
        ["launcher.nproc_per_node=2"],
        "launcher.nproc_per_node=2 with launcher.nnodes=1",
    ),
    "processes_fit_the_node": (
        ["launcher=torchrun", "launcher.nproc_per_node=8"],
        "launcher.nproc_per_node=8 must be <= hardware.gpus_per_node=4",
    ),
    "te_needs_gpu": (
        ["train.transformer_impl=transformer_engine"],
        "train.transformer_impl=transformer_engine needs GPU",
    ),
    "cuda_graphs_need_gpu": (["cuda_graph=attn"], "cuda_graph.impl=transformer_engine needs GPU hardware"),
    "fusions_need_gpu": (["fusions=on"], "fusions.bias_dropout=true needs GPU hardware"),
    "allocator_setting_needs_gpu": (
        ["train.expandable_segments=true"],
        "train.expandable_segments=true configures the CUDA caching allocator",
    ),
    "dense_layout_divides_world": (
        ["launcher=torchrun", "launcher.nproc_per_node=3", "parallel=3d", "parallel.tp=2", "parallel.sp=true"],
        "parallel.tp*pp*cp=2*1*1=2 must divide the world size 3",
    ),
    "expert_layout_divides_world": ([*T2, "parallel.ep=4"], "parallel.etp*ep*pp=1*4*1=4 must divide the world size 2"),
    "tp_divides_heads": (
        [*GPU, "launcher=torchrun", "launcher.nproc_per_node=8", "parallel=3d", "parallel.tp=8", "parallel.sp=true"],
        "parallel.tp=8 must divide model.decoder.num_attention_heads=4",
    ),
    # tiny has 4 heads in 2 KV groups; 6 heads in 3 groups at TP 2 are neither a multiple nor a divisor
    "tp_and_query_groups_divide": (
        [
            *GPU,
            *T2,
            "parallel=3d",
            "parallel.tp=2",
            "parallel.sp=true",
            "model.decoder.num_attention_heads=6",
            "model.decoder.num_query_groups=3",
            "model.decoder.kv_channels=16",
        ],
        "parallel.tp=2 must be a multiple or a divisor of model.decoder.num_query_groups=3 "
        "(megatron/core/transformer/transformer_config.py: num_query_groups % "
        "tensor_model_parallel_size == 0 or",
    ),
    # 4 groups at TP 8 replicate the KV heads, but the fused QKV's 3 x (8 + 2 x 1) = 30 outputs do not split in 4
    "tp_divides_fused_qkv": (
        [
            *GPU,
            "launcher=torchrun",
            "launcher.nproc_per_node=4",
            "parallel=3d",
            "parallel.tp=4",
            "parallel.sp=true",
            "model.decoder.num_attention_heads=8",
            "model.decoder.num_query_groups=1",
            "model.decoder.kv_channels=3",
            "model.vision.num_attention_heads=4",
        ],
        "parallel.tp=4 must divide the fused QKV width 30",
    ),
    "tp_divides_vision_heads": (
        [*T2, "parallel=3d", "parallel.tp=2", "parallel.sp=true", "model.vision.num_attention_heads=1"],
        "parallel.tp=2 must divide model.vision.num_attention_heads=1",
    ),
    "pp_divides_layers": (
        ["launcher=torchrun", "launcher.nproc_per_node=3", "parallel=3d", "parallel.pp=3"],
        "parallel.pp*vpp=3*1 must divide model.decoder.num_layers=2",
    ),
    "vpp_needs_pp": (["parallel=3d", "parallel.vpp=2"], "parallel.vpp=2 needs parallel.pp > 1"),
    "ep_divides_experts": (["model=small", "parallel.ep=3"], "parallel.ep=3 must divide model.decoder.num_experts=16"),
    "etp_divides_expert_ffn": (
        [*T2, "parallel=3d", "parallel.etp=2", "model.decoder.moe_ffn_hidden_size=63"],
        "parallel.etp=2 must divide model.decoder.moe_ffn_hidden_size=63",
    ),
    "sp_needs_tp": (["parallel.sp=true"], "parallel.sp=true needs parallel.tp > 1"),
    "moe_with_tp_needs_sp": (
        [*T2, "parallel=3d", "parallel.tp=2"],
        "parallel.tp=2 with MoE layers needs parallel.sp=true",
    ),
    "sp_needs_uniform_layers": (
        [*T2, "parallel=3d", "parallel.tp=2", "parallel.sp=true", "model.decoder.moe_layer_freq=2"],
        "model.decoder.moe_layer_freq=2 with parallel.sp/cp",
    ),
    "cp_needs_te": ([*T2, "parallel=3d", "parallel.cp=2"], "parallel.cp=2 needs Transformer Engine attention"),
    "sp_on_gpu_needs_te": (
        [*GPU, *T2, "parallel=3d", "parallel.tp=2", "parallel.sp=true", "train.transformer_impl=local"],
        "parallel.sp=true on GPU hardware needs train.transformer_impl=transformer_engine",
    ),
    "fsdp_has_no_pipeline": ([*T2, "parallel=fsdp", "parallel.pp=2"], "parallel.pp=2 with parallel=fsdp"),
    "gbs_divisible_by_mbs_dp": (["batch.mbs=3", "batch.gbs=4"], "batch.gbs=4 must be divisible by batch.mbs*dp=3*1=3"),
    "interleaving_needs_whole_microbatch_groups": (
        [
            *GPU,
            "launcher=torchrun",
            "launcher.nproc_per_node=4",
            "parallel=3d",
            "parallel.pp=4",
            "parallel.vpp=2",
            "model.decoder.num_layers=8",
            "batch.mbs=1",
            "batch.gbs=6",
        ],
        "parallel.vpp=2 interleaves the pipeline, which needs the micro-batches per step (batch.gbs / (batch.mbs * "
        "dp) = 6 / (1 * 1) = 6) to be a multiple of parallel.pp=4",
    ),
    "spatial_merge_needs_even_grid": (
        ["model.vision.spatial_merge=2", "model.vision.image_size=42"],
        "model.vision.spatial_merge=2 must divide the patch grid side 3",
    ),
    "selective_needs_modules": (
        ["recompute=selective", "recompute.modules=[]"],
        "recompute.modules=[] with recompute=selective",
    ),
    "full_recompute_needs_method": (
        ["recompute=full", "recompute.method=null"],
        "recompute=full needs recompute.method",
    ),
    "full_recompute_fields": (
        ["recompute=full", "recompute.num_layers=null"],
        "recompute=full needs recompute.num_layers",
    ),
    "recompute_layers_fit_stage": (
        ["recompute=full", "recompute.num_layers=3"],
        "recompute.num_layers=3 must be <= the 2 decoder layers",
    ),
    "moe_act_recompute_needs_te": (
        ["recompute=selective", "recompute.modules=[moe_act]"],
        "moe_act, which needs TE grouped GEMM",
    ),
    "mla_recompute_needs_mla": (
        ["recompute=selective", "recompute.modules=[mla_up_proj]"],
        "mla_up_proj, which needs multi-latent attention",
    ),
    "mlp_recompute_needs_dense_layers": (
        ["recompute=selective", "recompute.modules=[mlp]"],
        "contains mlp, which recomputes dense MLPs",
    ),
    "shared_expert_recompute_needs_shared_experts": (
        ["recompute=selective", "recompute.modules=[shared_experts]"],
        "moe_shared_expert_intermediate_size is not set",
    ),
    "graph_modules_need_impl": (["cuda_graph.modules=[attn]"], "cuda_graph.modules=['attn'] needs cuda_graph.impl"),
    "full_iteration_takes_no_modules": (
        [*GPU, "cuda_graph=full_iteration", "cuda_graph.modules=[attn]"],
        "must be empty with cuda_graph.impl=full_iteration",
    ),
    "full_iteration_cannot_capture_llava": (
        [*GPU, "cuda_graph=full_iteration"],
        "cuda_graph.impl=full_iteration cannot capture LLaVAModel",
    ),
    "graph_moe_scopes_exclusive": (
        [*GPU, "cuda_graph=attn", "cuda_graph.modules=[moe,moe_router]"],
        "both moe and moe_router",
    ),
    "graph_preprocess_needs_router": (
        [*GPU, "cuda_graph=attn", "cuda_graph.modules=[attn,moe_preprocess]"],
        "moe_preprocess, which needs moe_router",
    ),
    "graph_mlp_needs_dense_layers": (
        [*GPU, "cuda_graph=attn", "cuda_graph.modules=[mlp]"],
        "contains mlp, but every layer is MoE",
    ),
    "graph_mamba_needs_mamba": ([*GPU, "cuda_graph=attn", "cuda_graph.modules=[mamba]"], "no Mamba layers"),
    "graph_moe_needs_drop_and_pad": (
        [*GPU, "cuda_graph=attn", "cuda_graph.modules=[moe]"],
        "contains moe, which needs drop-and-pad",
    ),
    "whole_layer_graphs_need_drop_and_pad": (
        [*GPU, "cuda_graph=layer_te"],
        "cuda_graph.modules is empty (whole layers, experts included)",
    ),
    "graph_preprocess_vs_alltoall_capacity": (
        [*GPU, "cuda_graph=attn_moe_router_preprocess", "dispatcher.capacity_factor=1.0"],
        "rejects for dispatcher=alltoall with dispatcher.capacity_factor=1.0 unless dispatcher.pad_to_capacity=true",
    ),
    "local_graphs_need_drop_and_pad": (
        [*GPU, "cuda_graph=layer_local"],
        "cuda_graph.impl=local cannot capture dropless",
    ),
    "full_recompute_only_with_full_iteration": (
        [*GPU, "cuda_graph=attn", "recompute=full"],
        "recompute=full with cuda_graph.impl=transformer_engine",
    ),
    "moe_recompute_excludes_router_graph": (
        [*GPU, "cuda_graph=attn_moe_router", "recompute=selective", "recompute.modules=[moe]"],
        "a recomputed MoE block",
    ),
    "graph_warmup_within_warmup": (
        [*GPU, "cuda_graph=attn", "cuda_graph.warmup_steps=3", "train.warmup_steps=3"],
        "cuda_graph.warmup_steps=3 must be < train.warmup_steps=3",
    ),
    "fits_in_gpu_memory": (
        ["model=qwen3_vl_30b_a3b", "hardware=h200"],
        "more than hardware.memory_gib=139.8: shard further",
    ),
    "trace_needs_profile_steps": (
        ["train.trace=true", "train.profile_steps=0"],
        "train.trace=true traces the profile steps, but train.profile_steps=0",
    ),
    "layer_graphs_vs_fsdp": (
        [*GPU, "cuda_graph=attn", "parallel.fsdp_sharding=optim_grads"],
        "TE make_graphed_callables refuses modules with hooks",
    ),
    "te_graphs_need_te_specs": (
        [*GPU, "cuda_graph=attn", "train.transformer_impl=local"],
        "needs train.transformer_impl=transformer_engine",
    ),
    "flex_needs_backend": (["dispatcher.token_dispatcher=flex"], "needs dispatcher.flex_backend"),
    "flex_needs_gpu": (["dispatcher=flex_deepep"], "dispatcher=flex_deepep runs DeepEP CUDA kernels"),
    "deepep_needs_model_parallel": (
        [*GPU, *T2, "parallel=3d", "parallel.tp=2", "parallel.sp=true", "dispatcher=flex_deepep"],
        "dispatcher=flex_deepep needs parallel.etp*ep > 1 (got etp=1, ep=1)",
    ),
    "deepep_cannot_pad": (
        [*GPU, *T2, "parallel=3d", "parallel.ep=2", "dispatcher=flex_deepep", *DROP_AND_PAD],
        "for drop-and-pad (megatron/core/transformer/"
        "transformer_config.py: moe_pad_expert_input_to_capacity with the flex dispatcher's deepep "
        "backend)",
    ),
    "pad_needs_capacity": (["dispatcher.pad_to_capacity=true"], "dispatcher.pad_to_capacity=true needs"),
    "packing_excludes_cuda_graphs": (
        [*GPU, "data.packing=true", "cuda_graph=attn"],
        "data.packing=true with cuda_graph=attn: a graph replays the shapes",
    ),
    "packing_needs_unsharded_sequence": (
        [*GPU, *T2, "parallel=3d", "parallel.tp=2", "parallel.sp=true", "data.packing=true"],
        "data.packing=true with parallel.sp=true cp=1",
    ),
    "packing_on_local_specs_needs_unfused_softmax": (
        [*GPU, "train.transformer_impl=local", "data.packing=true"],
        "needs fusions.masked_softmax=false",
    ),
    "fp8_needs_fp8_hardware": (
        ["train.precision=fp8"],
        "train.precision=fp8 needs GPU hardware with FP8 GEMMs (Hopper or later), but hardware=cpu has "
        "hardware.fp8=false",
    ),
    "fp8_needs_te_specs": (
        [*GPU, "train.precision=fp8", "train.transformer_impl=local"],
        "with train.transformer_impl=local no layer is TE's",
    ),
    "fp8_delayed_excludes_moe_act_recompute": (
        [*GPU, "train.precision=fp8", "recompute=selective", "recompute.modules=[moe_act]"],
        "recompute.modules contains moe_act, which train.fp8_recipe=delayed cannot recompute",
    ),
    "fp8_excludes_packing": (
        [*GPU, "train.precision=fp8", "data.packing=true"],
        "train.precision=fp8 with data.packing=true",
    ),
    # model=tiny at 66 text tokens: an 81-token sequence, 162 tokens per micro-batch of 2
    "fp8_gemm_dims_align": (
        [*GPU, "train.precision=fp8", "model.text_tokens=66"],
        "(batch.mbs x the sequence shard) is 162 x 64; the 81-token sequence shard needs batch.mbs a multiple of 8",
    ),
    "packing_needs_one_stage": (
        [*GPU, "launcher=torchrun", "launcher.nproc_per_node=2", "parallel=3d", "parallel.pp=2", "data.packing=true"],
        "data.packing=true with parallel.pp=2",
    ),
}

# Field rules, checked by each group's __post_init__ at composition.
FIELD_CASES = [
    (["train.precision=fp16"], "train.precision='fp16' must be one of auto, bf16, fp32, fp8"),
    (["train.fp8_recipe=mxfp8"], "train.fp8_recipe='mxfp8' must be one of delayed, tensorwise, blockwise"),
    (["batch.mbs=0"], "batch.mbs=0 must be > 0"),
    (["model.decoder.moe_router_topk=8"], "model.decoder.moe_router_topk=8 must be <= model.decoder.num_experts=4"),
    (["model.vision.image_size=50"], "model.vision.image_size=50 must be a multiple of model.vision.patch_size=14"),
    (["recompute.modules=[foo]"], "recompute.modules[0]='foo' must be one of"),
    (["data.min_text_fraction=0"], "data.min_text_fraction=0.0 must be in (0, 1]"),
    (["model.decoder.num_query_groups=3"], "model.decoder.num_query_groups=3 must divide"),
    (["parallel.fsdp_sharding=full"], "parallel.fsdp_sharding='full' must be one of"),
    (["batch.mbz=1"], "Could not override 'batch.mbz'"),
    (["+batch.foo=1"], "unknown config key(s): batch.foo"),
    (["model=nope"], "Could not find 'model/nope'"),
    (["parallel.tp=two"], "parallel.tp=two"),
]


def test_every_rule_has_a_case():
    assert set(CASES) == {r.name for r in RULES}
    assert len(CASES) >= 25


def test_every_rule_names_its_reason_class_and_megatron_checks_name_their_source():
    """A user can look a mirrored check up (file and condition); every other refusal says why megatron-core
    would not make it."""
    for r in RULES:
        assert isinstance(r.basis, Basis)
        if r.basis in (Basis.MEGATRON, Basis.MODEL_BUILD):
            assert r.source and r.source.startswith("megatron/core/") and ".py: " in r.source, r
    assert sum(r.basis is Basis.MEGATRON for r in RULES) >= 15


def _check(capsys, overrides):
    code = main(["check", *overrides])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_rejects(name, capsys):
    overrides, expected = CASES[name]
    code, err = _check(capsys, overrides)
    assert code == EXIT_INVALID
    assert expected in err, err


@pytest.mark.parametrize("overrides,expected", FIELD_CASES, ids=[" ".join(o) for o, _ in FIELD_CASES])
def test_field_rule_rejects(overrides, expected, capsys):
    code, err = _check(capsys, overrides)
    assert code == EXIT_INVALID
    assert expected in err, err


def test_all_broken_rules_are_listed_together(capsys):
    code, err = _check(capsys, ["model=small", "parallel.ep=3", "batch.mbs=3", "batch.gbs=4"])
    assert code == EXIT_INVALID
    assert "parallel.ep=3 must divide model.decoder.num_experts=16" in err
    assert "batch.gbs=4 must be divisible by batch.mbs*dp=3*1=3" in err


@pytest.mark.parametrize("overrides", [["parallel.ep=3"], ["batch.mbz=1"], ["batch.mbs=0"]])
def test_invalid_run_launches_nothing(overrides, tmp_path, capsys):
    assert main(["run", *overrides, f"outputs_dir={tmp_path}"]) == EXIT_INVALID
    assert list(tmp_path.iterdir()) == []


def test_check_rejects_fast_without_importing_torch(tmp_path):
    """`check` runs on a login node: it must not pull in torch or megatron (seconds of import)."""
    code = (
        "import sys; from moe_vlm_sweep.cli import main; rc = main(['check', 'model=small', 'parallel.ep=3']); "
        "heavy = [m for m in ('torch', 'megatron', 'mlflow', 'optuna') if m in sys.modules]; "
        "assert not heavy, heavy; sys.exit(rc)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_INVALID, proc.stderr
    assert "parallel.ep=3 must divide model.decoder.num_experts=16" in proc.stderr


@pytest.mark.parametrize(
    "overrides, cudnn, refused",
    [
        (["cuda_graph=attn"], 91500, True),  # 1599 tokens: TE would run unfused attention
        (["cuda_graph=layer_te", *DROP_AND_PAD], 90800, True),  # whole layers hold attention too
        (["cuda_graph=attn"], 91501, False),  # cuDNN 9.15.1 keeps fused attention
        (["cuda_graph=attn", "model.text_tokens=1089"], 91500, False),  # 1664 = 13 x 128
        (["cuda_graph=attn", "cuda_graph.modules=[moe_router]"], 91500, False),  # attention stays eager
        (["cuda_graph=none"], 91500, False),
    ],
)
def test_graphed_attention_needs_a_cudnn_that_keeps_it_fused(overrides, cudnn, refused):
    """The machine-fact rule the worker's preflight applies (TE's nvte_get_fused_attn_backend, cuDNN <= 9.15.0)."""
    cfg = compose_run_config(
        ["model=small", "hardware=h200", "parallel=3d", "batch.mbs=16", "batch.gbs=32", "recompute=none", *overrides]
    )
    message = graphs_unfuse_attention(cfg, cudnn)
    assert (message is not None) == refused, message
    if refused:
        assert f"cuda_graph={cfg.cuda_graph.scope} graphs decoder attention" in message
        assert "(1599 decoder tokens) and runs unfused attention" in message
        assert "set model.text_tokens=1089 (1664 decoder tokens)" in message
    assert graphs_unfuse_attention(cfg, cudnn, flash_attn=True) is None  # TE would take flash-attn instead


@pytest.mark.parametrize(
    "overrides, cudnn, refused",
    [
        (["data.packing=true"], 90500, True),  # model=small has GQA: needs 9.6.0
        (["data.packing=true"], 90600, False),
        (["data.packing=true", "model.decoder.num_query_groups=16"], 90500, False),  # without GQA 9.1.0 does
        (["data.packing=true", "model.decoder.num_query_groups=16"], 90000, True),
        (["data.packing=false"], 90000, False),
    ],
)
def test_packed_attention_needs_a_cudnn_that_takes_thd(overrides, cudnn, refused):
    cfg = compose_run_config(
        ["model=small", "hardware=h200", "parallel=3d", "batch.mbs=16", "batch.gbs=32", *overrides]
    )
    message = packing_unfuses_attention(cfg, cudnn)
    assert (message is not None) == refused, message
    if refused:
        assert "data.packing=true runs THD attention" in message and "falls back to unfused attention" in message
    assert packing_unfuses_attention(cfg, cudnn, flash_attn=True) is None


@pytest.mark.parametrize(
    "tp, text_tokens, suggested",
    [
        (2, 1088, None),  # 1663 tokens, padded to 1664 for SP: TE sees 13 x 128
        (2, 1024, "1088 (1664 decoder tokens as padded)"),  # 1599, padded to 1600; 1663 pads to 1664 = 13 x 128
        (3, 1089, "1343 (1920 decoder tokens as padded)"),  # 1664 pads to 1665; 1918 pads to 1920, 5 x 384
    ],
)
def test_graphed_attention_rule_checks_the_length_as_padded_for_sequence_parallelism(tp, text_tokens, suggested):
    cfg = compose_run_config(
        [
            "model=small",
            "hardware=h200",
            "launcher=torchrun",
            f"launcher.nproc_per_node={tp}",
            "parallel=3d",
            f"parallel.tp={tp}",
            "parallel.sp=true",
            "batch.mbs=4",
            "batch.gbs=8",
            "recompute=none",
            "cuda_graph=attn",
            f"model.text_tokens={text_tokens}",
        ]
    )
    message = graphs_unfuse_attention(cfg, 91400)
    assert (message is not None) == (suggested is not None), message
    if suggested:
        assert "padded for SP" in message and f"set model.text_tokens={suggested}" in message


@pytest.mark.parametrize("text_tokens, suggested", [(705, "958 (1536"), (1089, "1470 (2048"), (1473, None)])
def test_graphed_attention_under_cp_needs_every_ring_chunk_a_multiple_of_128(text_tokens, suggested):
    """cp=2: TE checks KV chunks of seq/2 and seq/4, so seq must be a multiple of 512 (1280 and 1664 are not)."""
    cfg = compose_run_config(
        [
            "model=small",
            "hardware=h200",
            "launcher=torchrun",
            "launcher.nproc_per_node=2",
            "parallel=3d",
            "parallel.cp=2",
            "batch.mbs=4",
            "batch.gbs=8",
            "recompute=none",
            "cuda_graph=attn",
            f"model.text_tokens={text_tokens}",
        ]
    )
    message = graphs_unfuse_attention(cfg, 91400, flash_attn=True)
    assert (message is not None) == (suggested is not None), message
    if suggested:
        assert "parallel.cp=2 ring chunks" in message and "the capture fails" in message
        assert f"set model.text_tokens={suggested} decoder tokens as padded)" in message


def test_check_warns_that_graphed_attention_needs_a_newer_cudnn(capsys):
    """`check` cannot know the worker's cuDNN, so it says what the preflight will require."""
    base = [
        "check",
        "model=small",
        "hardware=h200",
        "cuda_graph=attn",
        "batch.gbs=32",
        "batch.mbs=16",
        "parallel=3d",
        "recompute=none",
    ]
    assert main(base) == 0
    assert "needs cuDNN >= 9.15.1 where it runs" in capsys.readouterr().out
    assert main([*base, "model.text_tokens=1089"]) == 0
    assert "needs cuDNN" not in capsys.readouterr().out


def test_graph_rules_do_not_ask_deepep_to_pad(capsys):
    """DeepEP cannot pad to capacity (megatron-core refuses it), so a graph that needs drop-and-pad says which
    dispatchers can."""
    code, err = _check(
        capsys, [*GPU, *T2, "parallel=3d", "parallel.ep=2", "dispatcher=flex_deepep", "cuda_graph=layer_te"]
    )
    assert code == EXIT_INVALID
    assert "dispatcher=flex_deepep cannot pad: use dispatcher=alltoall or allgather with" in err, err
