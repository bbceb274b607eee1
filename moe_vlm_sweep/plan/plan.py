"""RunConfig -> RunPlan: the validated, frozen, JSON-serializable description of one run.

The worker receives the plan as a file (``plan.json``), never a Hydra config, so a run can be replayed from its
run directory alone and the worker needs neither Hydra nor the sweep stack.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config import recipe, schema
from moe_vlm_sweep.config.codec import DecodeError, from_dict, to_dict
from moe_vlm_sweep.config.schema import RunConfig
from moe_vlm_sweep.plan.layout import Layout, layout_of, sharded_seq_length
from moe_vlm_sweep.plan.memory import estimate
from moe_vlm_sweep.plan.rules import ConfigError, broken_rules

PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    version: int
    config: dict[str, Any]
    """The resolved RunConfig as plain data."""
    overrides: list[str]
    """The Hydra overrides this run was composed from (for the exact re-run command)."""
    layout: Layout
    num_microbatches: int
    """Micro-batches per step on each DP rank: gbs / (mbs * dp); gradients really accumulate over them."""
    seq_length: int
    """Decoder tokens per sample (text with image tokens inserted), after LLaVA pads it to a multiple of the
    sequence shard factor (tp under SP, 2*cp under CP)."""
    tokens_per_step: int
    """Padded decoder tokens per optimizer step over the whole world: gbs * seq_length."""
    device: str
    precision: str
    transformer_impl: str
    fusions: dict[str, bool]
    predicted_peak_memory_gib: float | None = None
    """GPU runs: the lower-bound peak memory of the most loaded rank (``plan/memory.py``); None on the CPU."""
    fp8_recipe: str | None = None
    """The FP8 recipe the decoder's GEMMs run (``train.precision=fp8``), or None; ``precision`` is then bf16, the
    dtype parameters and activations keep."""
    recipe: dict[str, Any] | None = None
    """What the run trains (``config/recipe.py``): ``fingerprint``, a short hash of the recipe fields, and
    ``differs``, the recipe fields that differ from the model's defaults."""

    @property
    def run_config(self) -> RunConfig:
        return schema.from_dict(RunConfig, self.config)

    @property
    def decoder_row_length(self) -> int:
        """The longest row the decoder may see: one sample's sequence, or a packed micro-batch's samples back to
        back (LLaVA truncates its combined embedding to this)."""
        return self.seq_length * (self.run_config.batch.mbs if self.run_config.data.packing else 1)

    @property
    def graph_rng(self) -> str:
        """The RNG tracker CUDA graphs can capture: ``te`` (TE's tracker, with TE specs), ``cudagraphable``
        (megatron's, for ``local`` graphs without TE) or ``default`` (no per-layer graphs)."""
        if self.run_config.cuda_graph.impl not in ("local", "transformer_engine"):
            return "default"
        return "te" if self.transformer_impl == "transformer_engine" else "cudagraphable"

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunPlan:
        if data.get("version") != PLAN_VERSION:
            raise DecodeError(f"plan version {data.get('version')!r} is not {PLAN_VERSION}")
        return from_dict(cls, data, where="plan")

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> RunPlan:
        return cls.from_dict(json.loads(path.read_text()))


def make_plan(cfg: RunConfig, overrides: list[str] | tuple[str, ...] = (), *, validate: bool = True) -> RunPlan:
    """Validate ``cfg`` against every rule and freeze it; raise :class:`ConfigError` listing all broken rules.

    ``validate=False`` freezes a config the rules refuse, so that megatron-core's own checks can be held against
    the rule table (``tests/test_rules_vs_megatron.py``); such a plan is never launched."""
    problems = broken_rules(cfg) if validate else []
    if problems:
        raise ConfigError(problems)
    layout = layout_of(cfg)
    on_gpu = cfg.hardware.device == "cuda"
    return RunPlan(
        version=PLAN_VERSION,
        config=to_dict(cfg),
        overrides=list(overrides),
        layout=layout,
        num_microbatches=cfg.batch.gbs // (cfg.batch.mbs * layout.dp),
        seq_length=sharded_seq_length(cfg),
        tokens_per_step=cfg.batch.gbs * sharded_seq_length(cfg),
        device=cfg.hardware.device,
        precision=cfg.train.resolved_precision(cfg.hardware.device),
        transformer_impl=cfg.train.resolved_transformer_impl(cfg.hardware.device),
        fusions=cfg.fusions.resolved(on_gpu=on_gpu),
        fp8_recipe=cfg.train.fp8_in_use,
        predicted_peak_memory_gib=round(estimate(cfg).total_gib, 2) if on_gpu else None,
        recipe=recipe.summary(cfg),
    )


def describe(plan: RunPlan, notes: Mapping[str, str] | None = None) -> str:
    """The resolved plan as a person checks it: layout, batch arithmetic, tokens. ``notes`` adds to a row what is
    checked later, where the run lands (the worker's preflight: ``train/machine_rules.preflight_notes``)."""
    cfg, lay = plan.run_config, plan.layout
    rows = [
        (
            "model",
            f"{cfg.model.name} (vision {cfg.model.vision.kind} {cfg.model.vision.num_layers}L, decoder "
            f"{cfg.model.decoder.num_layers}L {cfg.model.decoder.num_experts} experts "
            f"top-{cfg.model.decoder.moe_router_topk})",
        ),
        (
            "hardware",
            f"{cfg.hardware.name} ({plan.device}, {plan.transformer_impl} specs, {plan.precision}"
            + (f", decoder GEMMs in FP8 ({plan.fp8_recipe} scaling)" if plan.fp8_recipe else "")
            + ")",
        ),
        (
            "launcher",
            f"{cfg.launcher.name}: {cfg.launcher.nnodes} node(s) x {cfg.launcher.nproc_per_node} "
            f"= world {lay.world_size}",
        ),
        (
            "parallel",
            f"{cfg.parallel.strategy}"
            + (f" ({cfg.parallel.fsdp_sharding})" if cfg.parallel.strategy == "fsdp" else ""),
        ),
        (
            "layout",
            f"tp={lay.tp} pp={lay.pp} vpp={lay.vpp} cp={lay.cp} ep={lay.ep} etp={lay.etp} "
            f"sp={str(lay.sp).lower()} -> dp={lay.dp}, expert dp={lay.edp}",
        ),
        (
            "batch",
            f"gbs={cfg.batch.gbs} = mbs {cfg.batch.mbs} x dp {lay.dp} x {plan.num_microbatches} micro-batches per step",
        ),
        (
            "sequence",
            f"{plan.seq_length} decoder tokens/sample = {cfg.model.text_tokens} text + "
            f"{cfg.model.images_per_sample} image(s) x {cfg.model.image_tokens} tokens - placeholders",
        ),
        (
            "tokens/step",
            f"{plan.tokens_per_step} (padded)"
            + (
                "; packed: each micro-batch runs its samples' real tokens back to back in one row ("
                + ("THD" if plan.transformer_impl == "transformer_engine" else "block-causal mask")
                + ")"
                if cfg.data.packing
                else ""
            ),
        ),
        *(
            [
                (
                    "memory",
                    f">= {plan.predicted_peak_memory_gib:.1f} GiB per GPU (lower bound, plan/memory.py) of "
                    f"{cfg.hardware.memory_gib} GiB",
                )
            ]
            if plan.predicted_peak_memory_gib is not None
            else []
        ),
        ("recompute", cfg.recompute.granularity + (f" {cfg.recompute.modules}" if cfg.recompute.modules else "")),
        (
            "cuda_graph",
            f"{cfg.cuda_graph.scope} (impl {cfg.cuda_graph.impl})",
        ),
        ("dispatcher", cfg.dispatcher.name),
        ("vision", cfg.vision.name),
        ("fusions", ", ".join(k for k, v in plan.fusions.items() if v) or "none"),
        ("data", f"{cfg.data.name} (realism {cfg.data.realism})"),
        *(
            [
                (
                    "recipe",
                    f"{plan.recipe['fingerprint']} (differs from model={cfg.model.name}'s defaults: "
                    f"{recipe.describe(plan.recipe['differs'])})",
                )
            ]
            if plan.recipe
            else []
        ),
    ]
    notes = notes or {}
    rows = [(k, f"{v}; {notes[k]}" if k in notes else v) for k, v in rows]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
