"""The rule table held against megatron-core 0.19.2's own checks, on the CPU, for seeded random GPU configs.

For each config ``check`` gives a verdict (the rules it breaks, each with its reason class) and megatron-core gives
one (``tests/megatron_checks.py``: parallel_state's groups over the config's world, the micro-batch calculator, the
decoder's, ViT's and projector's ``TransformerConfig`` from the worker's own mapping, the layers each pipeline stage
builds, the token dispatcher's constructor, the interleaved schedule's micro-batch checks and, on local specs,
LLaVA's constructor). Required:

- megatron-core refuses -> ``check`` refuses, through a rule that mirrors a check megatron-core made
  (``Basis.MEGATRON``, or a LLaVA model-construction rule where LLaVA's constructor ran);
- megatron-core accepts -> no such rule fires: every refusal it does not make is labelled memory, machine/runtime,
  LLaVA model construction (checks not run here) or a knob megatron would silently ignore.

What the CPU stands in for is listed in ``megatron_checks.STOOD_IN`` (TE's fused kernels marked present; DeepEP's
and HybridEP's absence counted as accepted after the dispatcher's own checks; torch's fake process groups; the
worker's CPU patches for device placement).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_checks import LLAVA_SOURCE, STOOD_IN
from omegaconf import OmegaConf

from moe_vlm_sweep.config.compose import compose_config, compose_run_config, to_run_config
from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.plan.plan import make_plan
from moe_vlm_sweep.plan.rules import Basis, Rule, broken

SEED, N_CONFIGS = 29, 300
HERE = Path(__file__).resolve().parent


def mirrors_a_check_made(rule: Rule, llava_ran: bool) -> bool:
    return rule.basis is Basis.MEGATRON or (
        llava_ran and rule.basis is Basis.MODEL_BUILD and rule.source.startswith(LLAVA_SOURCE)
    )


GROUPS = {
    "model": ["tiny", "tiny", "small", "small", "qwen3_vl_30b_a3b_proxy", "qwen3_vl_30b_a3b", "qwen3_vl_235b_a22b"],
    "hardware": ["h100", "h200", "b200", "gb200"],
    "parallel": ["3d", "3d", "fsdp"],
    "recompute": ["none", "none", "selective", "full"],
    "cuda_graph": [
        "none",
        "none",
        "none",
        "none",
        "attn",
        "attn_moe_router",
        "attn_moe_router_preprocess",
        "layer_te",
        "layer_local",
        "full_iteration",
    ],
    "dispatcher": ["alltoall", "alltoall", "allgather", "flex_deepep", "flex_hybridep"],
    "fusions": ["auto", "auto", "on", "off"],
    "launcher": ["torchrun"],
}


@functools.cache
def _base():
    return compose_config(["launcher=torchrun"])


@functools.cache
def _group_node(group: str, option: str):
    return compose_config([f"{group}={option}"])[group]


def _fast_compose(overrides: list[str]) -> RunConfig:
    """What ``compose_run_config(overrides)`` gives, from cached group nodes (Hydra's compose costs ~0.4 s):
    the groups are independent YAML files, so a group's node does not depend on the others."""
    cfg = copy.deepcopy(_base())
    for item in overrides:
        key, value = item.split("=", 1)
        if key in GROUPS:
            cfg[key] = copy.deepcopy(_group_node(key, value))
        else:
            OmegaConf.update(cfg, key, OmegaConf.create({"v": value_of(value)})["v"], merge=False)
    return to_run_config(cfg)


def value_of(text: str):
    return OmegaConf.create(f"v: {text}")["v"]


def _pick(rng: random.Random, *weighted):
    return rng.choice(weighted)


def random_overrides(rng: random.Random) -> list[str]:
    """A new user's GPU config: a group option each, then knobs of every group, often but not always coherent."""
    o = [f"{group}={rng.choice(options)}" for group, options in GROUPS.items()]
    groups = dict(item.split("=") for item in o)
    nnodes, nproc = _pick(rng, 1, 1, 1, 2, 4, 8), _pick(rng, 1, 2, 2, 4, 8, 8)
    world = nnodes * nproc
    o += [f"launcher.nnodes={nnodes}", f"launcher.nproc_per_node={nproc}"]
    if rng.random() < 0.6:  # a layout that fits the world, as most users would pick
        tp = rng.choice([d for d in (1, 2, 4, 8) if world % d == 0])
        pp = rng.choice([d for d in (1, 2, 4) if world // tp % d == 0])
        cp = rng.choice([d for d in (1, 1, 2) if world // (tp * pp) % d == 0])
        ep = rng.choice([d for d in (1, 2, 4, 8) if world // pp % d == 0])
        etp = rng.choice([d for d in (1, 1, 2) if world // (pp * ep) % d == 0])
        vpp = _pick(rng, 1, 2) if pp > 1 else 1
        sp = tp > 1
    else:
        tp = _pick(rng, 1, 1, 2, 2, 4, 8, 3)
        pp, cp = _pick(rng, 1, 1, 2, 2, 4, 3), _pick(rng, 1, 1, 1, 2, 4)
        vpp = _pick(rng, 1, 2, 2, 3) if pp > 1 else _pick(rng, *[1] * 15, 2)
        ep, etp = _pick(rng, 1, 1, 2, 4, 8, 16, 3), _pick(rng, 1, 1, 1, 2, 4)
        sp = (tp > 1 and rng.random() < 0.85) or rng.random() < 0.03
    o += [
        f"parallel.tp={tp}",
        f"parallel.pp={pp}",
        f"parallel.vpp={vpp}",
        f"parallel.cp={cp}",
        f"parallel.ep={ep}",
        f"parallel.etp={etp}",
        f"parallel.sp={str(sp).lower()}",
    ]
    dp = max(world // (tp * pp * cp), 1)
    mbs = _pick(rng, 1, 1, 2, 4)
    gbs = mbs * dp * _pick(rng, 1, 2, 3, 4, 8) * (pp if vpp > 1 and rng.random() < 0.7 else 1)
    gbs = gbs if rng.random() < 0.85 else rng.randint(1, 64)
    o += [f"batch.mbs={mbs}", f"batch.gbs={gbs}"]
    if groups["recompute"] == "selective":
        o.append(f"recompute.modules=[{','.join(rng.sample(['core_attn', 'moe_act', 'layernorm', 'moe'], 2))}]")
    if groups["recompute"] == "full":
        o.append(f"recompute.num_layers={_pick(rng, 1, 1, 2)}")
        if rng.random() < 0.2:
            o.append("recompute.method=null")
    if rng.random() < 0.15:
        o.append(f"cuda_graph.modules=[{','.join(rng.sample(['attn', 'moe', 'moe_router', 'moe_preprocess'], 2))}]")
    if rng.random() < 0.5:
        o += [
            f"dispatcher.capacity_factor={_pick(rng, 1.0, 1.5)}",
            f"dispatcher.pad_to_capacity={str(rng.random() < 0.6).lower()}",
        ]
    elif rng.random() < 0.1:
        o.append("dispatcher.pad_to_capacity=true")
    o.append(f"train.transformer_impl={_pick(rng, 'auto', 'auto', 'auto', 'auto', 'local', 'transformer_engine')}")
    o.append(f"train.warmup_steps={_pick(rng, 2, 3, 3)}")
    if rng.random() < 0.1:
        o.append("data.packing=true")
    if rng.random() < 0.4:
        o.append(f"model.text_tokens={rng.randint(40, 2100)}")
    if groups["model"] in ("tiny", "small") and rng.random() < 0.3:
        o.append(f"model.decoder.num_query_groups={_pick(rng, 1, 2, 4)}")
    if rng.random() < 0.08:
        o.append("model.decoder.moe_layer_freq=2")
    return o


# The examples of disagreement megatron-core settled: overrides, megatron-core refuses?, the rule (or None).
EXAMPLES = {
    "deepep_with_pad_to_capacity": (
        "hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.ep=2 dispatcher=flex_deepep "
        "dispatcher.capacity_factor=1.0 dispatcher.pad_to_capacity=true",
        True,
        "deepep_cannot_pad",
    ),
    "interleaving_with_too_few_microbatches": (
        "model=small hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.pp=2 "
        "parallel.vpp=2 batch.mbs=1 batch.gbs=1",
        True,
        "interleaving_needs_whole_microbatch_groups",
    ),
    "interleaving_with_a_short_last_group": (
        "model=small hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.pp=2 "
        "parallel.vpp=2 batch.mbs=1 batch.gbs=3",
        True,
        "interleaving_needs_whole_microbatch_groups",
    ),
    "interleaving_with_whole_groups": (
        "model=small hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.pp=2 "
        "parallel.vpp=2 batch.mbs=1 batch.gbs=4",
        False,
        None,
    ),
    "deepep_counts_expert_tp_not_tp": (
        "hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.tp=2 parallel.sp=true "
        "dispatcher=flex_deepep",
        True,
        "deepep_needs_model_parallel",
    ),
    "deepep_over_expert_tp_alone": (
        "hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.etp=2 dispatcher=flex_deepep",
        False,
        None,
    ),
    "cp_pads_an_odd_sequence": (  # small: 1599 decoder tokens, padded by LLaVA to 1600 for cp=2
        "model=small hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.cp=2",
        False,
        None,
    ),
    "tp_above_query_groups": (  # Qwen3-VL: 4 KV groups, replicated over TP 8
        "model=qwen3_vl_30b_a3b_proxy hardware=h200 launcher=torchrun launcher.nproc_per_node=8 parallel=3d "
        "parallel.tp=8 parallel.sp=true batch.mbs=1 batch.gbs=2",
        False,
        None,
    ),
    "tp_neither_multiple_nor_divisor_of_query_groups": (
        "model=small hardware=h200 launcher=torchrun launcher.nproc_per_node=4 parallel=3d parallel.tp=4 "
        "parallel.sp=true model.decoder.num_attention_heads=24 model.decoder.num_query_groups=6 "
        "model.decoder.kv_channels=64 batch.mbs=1 batch.gbs=1",
        True,
        "tp_and_query_groups_divide",
    ),
    "drop_and_pad_with_preprocess_graphs": (
        "model=small hardware=h200 parallel=3d cuda_graph=attn_moe_router_preprocess dispatcher.capacity_factor=1.0 "
        "dispatcher.pad_to_capacity=true batch.mbs=1 batch.gbs=1",
        False,
        None,
    ),
    "dropping_without_padding_with_preprocess_graphs": (
        "model=small hardware=h200 parallel=3d cuda_graph=attn_moe_router_preprocess dispatcher.capacity_factor=1.0 "
        "batch.mbs=1 batch.gbs=1",
        True,
        "graph_preprocess_vs_alltoall_capacity",
    ),
}
EXAMPLES["sp_with_local_specs_on_gpu"] = (  # LLaVA's constructor refuses it
    "hardware=h200 launcher=torchrun launcher.nproc_per_node=2 parallel=3d parallel.tp=2 parallel.sp=true "
    "train.transformer_impl=local",
    True,
    "sp_on_gpu_needs_te",
)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """megatron-core's verdict on every example and every random config, in one process of its own."""
    rng = random.Random(SEED)
    samples = [random_overrides(rng) for _ in range(N_CONFIGS)]
    configs = [compose_run_config(o.split()) for o, _, _ in EXAMPLES.values()] + [_fast_compose(s) for s in samples]
    folder = tmp_path_factory.mktemp("megatron")
    (folder / "plans.json").write_text(json.dumps([make_plan(c, validate=False).to_dict() for c in configs]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / "megatron_checks.py"), str(folder / "plans.json"), str(folder / "verdicts.json")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads((folder / "verdicts.json").read_text())
    return dict(zip(EXAMPLES, found[: len(EXAMPLES)])), list(
        zip(samples, configs[len(EXAMPLES) :], found[len(EXAMPLES) :])
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_behaves_as_megatron_core_does(name, verdicts, capsys):
    from moe_vlm_sweep.cli import EXIT_INVALID, main

    overrides, refused, rule_name = EXAMPLES[name]
    found = verdicts[0][name]["refused"]
    assert (found is not None) == refused, found
    fired = {r.name: msg for r, msg in broken(compose_run_config(overrides.split()))}
    if refused:
        assert rule_name in fired, fired
        assert main(["check", *overrides.split()]) == EXIT_INVALID
        assert fired[rule_name] in capsys.readouterr().err
    else:
        assert main(["check", *overrides.split()]) == 0, capsys.readouterr().err


def test_fast_composition_matches_hydra():
    rng = random.Random(SEED + 1)
    for _ in range(3):
        overrides = random_overrides(rng)
        assert _fast_compose(overrides) == compose_run_config(overrides)


def test_check_agrees_with_megatron_core_on_random_configs(verdicts):
    _, results = verdicts
    missed, wrongly_megatron = [], []
    passed = refused_by_megatron = labelled = 0
    for overrides, cfg, found in results:
        fired, megatron = broken(cfg), found["refused"]
        mirrors = [r.name for r, _ in fired if mirrors_a_check_made(r, found["llava"])]
        passed += not fired
        refused_by_megatron += megatron is not None
        if megatron is not None and not mirrors:
            missed.append(
                f"{' '.join(overrides)}\n    megatron-core: {megatron}\n    check: "
                f"{[r.name for r, _ in fired] or 'passes'}"
            )
        if megatron is None and mirrors:
            wrongly_megatron.append(f"{' '.join(overrides)}\n    labelled megatron-core's: {mirrors}")
        labelled += megatron is None and bool(fired)
    stood_in = "\nstood in on the CPU:\n  " + "\n  ".join(STOOD_IN)
    assert not missed, "megatron-core refuses, but no rule mirrors its check:\n" + "\n".join(missed) + stood_in
    assert not wrongly_megatron, (
        "megatron-core accepts, but a rule says it mirrors megatron-core's check:\n"
        + "\n".join(wrongly_megatron)
        + stood_in
    )
    # the sample must exercise both sides and the labelled refusals in between
    assert passed >= 20 and refused_by_megatron >= 50 and labelled >= 20, (passed, refused_by_megatron, labelled)
