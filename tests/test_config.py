"""Every option of every group composes, and each model has a valid plan."""

from __future__ import annotations

from collections.abc import Iterator
from enum import Enum
from typing import Any

import pytest
import yaml

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.config.compose import CONF_DIR, compose_run_config
from moe_vlm_sweep.config.store import GROUP_SCHEMAS
from moe_vlm_sweep.plan.plan import make_plan
from moe_vlm_sweep.plan.rules import ConfigError

OPTIONS = sorted((group, path.stem) for group in GROUP_SCHEMAS for path in (CONF_DIR / group).glob("*.yaml"))

# Options that are only valid with GPU hardware (they compose anywhere, but the plan needs a GPU).
GPU_ONLY = {("fusions", "on"), ("dispatcher", "flex_deepep"), ("dispatcher", "flex_hybridep")}


def test_every_group_has_options():
    assert {g for g, _ in OPTIONS} == set(GROUP_SCHEMAS)


def _leaves(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, str(key)))
    else:
        yield path, node


def _value(cfg: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        cfg = getattr(cfg, key)
    return cfg.value if isinstance(cfg, Enum) else cfg


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes(group, option):
    """Every value the option's file sets reaches the composed config; an option that sets nothing is the
    schema's defaults."""
    written = yaml.safe_load((CONF_DIR / group / f"{option}.yaml").read_text())
    written.pop("defaults", None)
    cfg = compose_run_config([f"{group}={option}"])
    if not written:
        assert getattr(cfg, group) == GROUP_SCHEMAS[group]()
    for path, value in _leaves(written):
        assert _value(getattr(cfg, group), path) == value, f"{group}.{'.'.join(path)}"


@pytest.mark.parametrize("group,option", sorted(GPU_ONLY))
def test_gpu_only_options_plan_on_gpu(group, option):
    """They plan with GPU hardware, keep their choice there, and are refused on the CPU by a rule naming them."""
    extra = ["parallel=3d", "launcher=torchrun", "launcher.nproc_per_node=4", "parallel.ep=4", "batch.gbs=8"]
    plan = make_plan(compose_run_config(["hardware=h200", *extra, f"{group}={option}"]))
    assert plan.device == "cuda" and getattr(plan.run_config, group).name == option
    with pytest.raises(ConfigError, match=rf"{group}.*needs GPU hardware.*not hardware=cpu"):
        make_plan(compose_run_config(["hardware=cpu", *extra, f"{group}={option}"]))


@pytest.mark.parametrize("model", ["tiny", "small", "qwen3_vl_30b_a3b", "qwen3_vl_235b_a22b"])
def test_check_accepts_each_model(model, capsys):
    assert main(["check", f"model={model}"]) == 0
    out = capsys.readouterr().out
    assert f"model        {model}" in out and out.strip().endswith("valid")


def test_small_model_matches_reference_shapes():
    plan = make_plan(compose_run_config(["model=small", "batch.mbs=8", "batch.gbs=8"]))
    m = plan.run_config.model
    assert (m.vision.image_size, m.vision.patch_size, m.vision.hidden_size) == (336, 14, 768)
    assert (m.decoder.num_layers, m.decoder.hidden_size, m.decoder.num_experts, m.decoder.moe_router_topk) == (
        12,
        1024,
        16,
        2,
    )
    assert plan.seq_length == 1024 + 576 - 1
    assert plan.tokens_per_step == 8 * 1599


def test_cluster_plan_arithmetic(capsys):
    overrides = [
        "model=qwen3_vl_235b_a22b",
        "hardware=h200",
        "launcher=torchrun",
        "launcher.nproc_per_node=8",
        "launcher.nnodes=32",
        "parallel=3d",
        "parallel.tp=4",
        "parallel.sp=true",
        "parallel.pp=2",
        "parallel.ep=32",
        "batch.mbs=1",
        "batch.gbs=1024",
    ]
    plan = make_plan(compose_run_config(overrides))
    lay = plan.layout
    assert (lay.world_size, lay.dp, lay.edp) == (256, 32, 4)
    assert plan.num_microbatches == 1024 // 32
    # 2048 text + 576 merged image tokens - 1 placeholder = 2623, padded by LLaVA to a multiple of tp=4 for SP.
    assert plan.seq_length == 2624
    assert main(["check", *overrides]) == 0
    assert "dp=32" in capsys.readouterr().out
