"""Two kinds of knob: what a run trains (the *recipe*) and how fast it trains it (*performance*).

A throughput search may change only performance knobs, or its winner trains another model than the user meant:
a frozen vision stack, dropped tokens, a longer sequence, another global batch. Every field of every config group
is classified here, in one table next to the schema (``tests/test_recipe.py`` fails for a field left out), and a
run's recipe is summed up by :func:`fingerprint`: a short hash of its recipe fields, which ``check`` prints,
``plan.json`` and ``metrics.json`` carry, and by which ``best``, the export and the confirmation group trials.

Performance: the parallel layout, MBS at a fixed GBS, recompute, CUDA graph scopes, the dispatcher's backend,
fusions, packing, allocator settings, the hardware and launcher, and how a run is measured and tracked (steps,
warm-up, profiling, timeouts). Recipe: the model's shape and sequence, vision freezing, token dropping (the
dispatcher's capacity factor and padding), GBS, precision, optimizer and LR, the data source and realism, seeds.

CUDA graph scopes that capture the experts need drop-and-pad dispatch (``plan/rules.py``): choosing one is a
recipe change too, which :func:`token_dropping_scope` tells the sweep's check.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import typing
from collections.abc import Callable, Iterator
from typing import Any

from moe_vlm_sweep.config.choices import Precision
from moe_vlm_sweep.config.schema import FusionsConf, HardwareConf, ModelConf, RunConfig, TrainConf, from_dict


class Knob(enum.Enum):
    PERFORMANCE = "performance"
    """Changes how fast the same model trains, not what it learns (up to floating-point reduction order)."""
    RECIPE = "recipe"
    """Changes what is trained: the model, its data, its optimization. A search keeps these unless told."""


P, R = Knob.PERFORMANCE, Knob.RECIPE

MEASUREMENT = tuple(
    f"train.{f}"
    for f in (
        "warmup_steps",
        "steps",
        "target_cv",
        "min_steps",
        "profile_steps",
        "trace",
        "trace_first_step",
        "activation_census",
        "timeout_s",
    )
)
"""The fields that say how long and how a run is measured: neither the optimization nor a step's speed."""

KNOBS: dict[str, Knob] = {
    # model: the architecture and the sequence it sees, every field of it
    "model.name": R,
    "model.images_per_sample": R,
    "model.text_tokens": R,
    **{
        f"model.vision.{f}": R
        for f in (
            "kind",
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "patch_size",
            "image_size",
            "class_token_len",
            "spatial_merge",
        )
    },
    "model.projector.kind": R,
    "model.projector.ffn_hidden_size": R,
    **{
        f"model.decoder.{f}": R
        for f in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "ffn_hidden_size",
            "num_experts",
            "moe_router_topk",
            "moe_ffn_hidden_size",
            "moe_shared_expert_intermediate_size",
            "moe_layer_freq",
            "moe_aux_loss_coeff",
            "vocab_size",
            "rotary_base",
            "normalization",
        )
    },
    # parallel layout
    **{
        f"parallel.{f}": P
        for f in (
            "strategy",
            "tp",
            "pp",
            "vpp",
            "cp",
            "ep",
            "etp",
            "sp",
            "fsdp_sharding",
            "overlap_grad_reduce",
            "overlap_param_gather",
        )
    },
    # the global batch is the optimizer's; its split into micro-batches is not
    "batch.mbs": P,
    "batch.gbs": R,
    "recompute.granularity": P,
    "recompute.modules": P,
    "recompute.method": P,
    "recompute.num_layers": P,
    "cuda_graph.scope": P,
    "cuda_graph.impl": P,
    "cuda_graph.modules": P,
    "cuda_graph.warmup_steps": P,
    # dropless routing over any backend is the same model; a capacity factor drops (or pads) tokens
    "dispatcher.name": P,
    "dispatcher.token_dispatcher": P,
    "dispatcher.flex_backend": P,
    "dispatcher.capacity_factor": R,
    "dispatcher.pad_to_capacity": R,
    "vision.name": R,
    "vision.freeze_encoder": R,
    "vision.freeze_projector": R,
    **{f"fusions.{f}": P for f in ("name", *FusionsConf.FIELDS)},  # linear_cross_entropy: the same loss, chunked
    # (tests hold it to megatron's)
    # packing runs the same samples without padding; the source, its realism and its seed are the data
    "data.name": R,
    "data.realism": R,
    "data.min_text_fraction": R,
    "data.fixed_batch": R,
    "data.packing": P,
    "data.seed": R,
    "data.loader_workers": P,
    "data.shards": R,
    **{f"hardware.{f}": P for f in ("name", "device", "peak_bf16_tflops", "memory_gib", "gpus_per_node", "fp8")},
    "launcher.name": P,
    "launcher.nproc_per_node": P,
    "launcher.nnodes": P,
    "tracking.name": P,
    "tracking.backend": P,
    "tracking.tracking_uri": P,
    "tracking.experiment": P,
    **dict.fromkeys(MEASUREMENT, P),
    "train.manual_gc": P,
    "train.expandable_segments": P,
    "train.transformer_impl": P,
    "train.seed": R,
    "train.lr": R,
    "train.precision": R,
    "train.fp8_recipe": R,  # FP8 GEMMs change the numerics: a search varies them only when told
    "outputs_dir": P,
}
"""Every leaf field of :class:`RunConfig`, by its dotted path, and its kind."""

TOKEN_DROPPING = "dispatcher.capacity_factor"
"""The field a search names when it varies token dropping (a capacity factor, or a graph scope that needs one)."""


def leaf_fields(cls: type = RunConfig, prefix: str = "") -> Iterator[str]:
    """Dotted paths of every leaf field of the (nested) config dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaf_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def kind(path: str) -> Knob:
    """The kind of the field at dotted ``path``; a path above fields (``vision``, ``model.decoder``) is a recipe
    path if any field under it is."""
    if path in KNOBS:
        return KNOBS[path]
    under = [k for p, k in KNOBS.items() if p.startswith(path + ".")]
    if not under:
        raise KeyError(f"{path} is not a config field")
    return R if R in under else P


def _leaf(conf: Any, path: str) -> Any:
    for part in path.split("."):
        conf = getattr(conf, part)
    return conf


def _trained_precision(cfg: RunConfig) -> str:
    t, device = cfg.train, cfg.hardware.device
    default = dataclasses.replace(t, precision=TrainConf().precision)
    if t.precision != Precision.fp8 and t.resolved_precision(device) == default.resolved_precision(device):
        return default.precision
    return t.precision


def _trained_fp8_recipe(cfg: RunConfig) -> str:
    return cfg.train.fp8_recipe if cfg.train.fp8_in_use else TrainConf().fp8_recipe


TRAINED: dict[str, Callable[[RunConfig], Any]] = {
    "train.precision": _trained_precision,
    "train.fp8_recipe": _trained_fp8_recipe,
}
"""Recipe fields read as what the run trains, not as written: a precision that trains as the default's on this
device reads as the default (``auto`` and ``bf16`` on a GPU are one recipe), and an FP8 scaling recipe counts
only where FP8 runs. A value that trains as the default hashes as the default, so the fingerprints of runs that
kept their defaults are those they always had."""


def recipe_values(cfg: RunConfig) -> dict[str, Any]:
    """The recipe fields of ``cfg``, dotted path -> value as trained (``TRAINED``), in the table's order."""
    return {path: TRAINED[path](cfg) if path in TRAINED else _leaf(cfg, path) for path, k in KNOBS.items() if k is R}


def fingerprint(cfg: RunConfig) -> str:
    """A short stable hash of the recipe fields: two runs with one fingerprint train the same model."""
    blob = json.dumps(recipe_values(cfg), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def differences(values: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The recipe fields of ``values`` whose value differs from ``base``'s (path -> value)."""
    return {path: value for path, value in values.items() if base.get(path, object()) != value}


def between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where recipe ``a`` differs from recipe ``b``, given each one's ``differs`` (from the model's defaults): a
    field only one of them lists is at its default in the other."""
    return {k: a.get(k, "default") for k in sorted({*a, *b}) if a.get(k, "default") != b.get(k, "default")}


def describe(diff: dict[str, Any]) -> str:
    return ", ".join(f"{path}={value}" for path, value in diff.items()) or "none"


def model_defaults(model_name: str, hardware: HardwareConf | None = None) -> RunConfig:
    """The default config of ``model=<model_name>``: the model group's option over the schema's defaults (what the
    other groups' default options hold), on ``hardware`` where given (a default that resolves per device, such as
    ``train.precision=auto``, is read there). A model not in the group (set field by field) gets the schema's
    model."""
    from omegaconf import OmegaConf  # here: the worker reads plans without OmegaConf or Hydra

    from moe_vlm_sweep.config.compose import CONF_DIR

    path = CONF_DIR / "model" / f"{model_name}.yaml"
    defaults = RunConfig() if hardware is None else RunConfig(hardware=hardware)
    if not path.is_file():
        return defaults
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(raw, dict)  # a config group option is a mapping
    raw.pop("defaults", None)
    return dataclasses.replace(defaults, model=from_dict(ModelConf, typing.cast("dict[str, Any]", raw)))


def summary(cfg: RunConfig) -> dict[str, Any]:
    """What plan.json and the trial record: ``fingerprint`` and the recipe fields that differ from the model's
    defaults (``differs``, path -> value)."""
    return {
        "fingerprint": fingerprint(cfg),
        "differs": differences(recipe_values(cfg), recipe_values(model_defaults(cfg.model.name, cfg.hardware))),
    }
