"""A search keeps the user's training recipe: a space that varies a recipe field fails at sweep start.

A throughput search ranks configs by speed; if a searched knob also changes what is trained (vision freezing,
token dropping, the sequence, the global batch: ``config/recipe.py``), its winner may be fast because it trains
less. So each param of ``sweep.params`` is checked before the study is touched: a param that can give two trials
different values of a recipe field needs the space's opt-in, ``allow_recipe_changes: [<param or field>]`` (or
``sweep.allow_recipe_changes=[vision]`` on the command line). With the opt-in the sweep runs, and ``best``, the
export and the confirmation rank each recipe fingerprint separately (``export/recipes.py``).

What a param varies:
- a field (``batch.gbs``, ``train.lr``): the field, unless it is a single unconditional choice (then every trial
  gets it: the recipe is the space's, fixed);
- a group (``vision``, ``dispatcher``): the recipe fields its options set to different values;
- a CUDA graph scope that captures the experts needs drop-and-pad dispatch (``plan/rules.py``), so choosing it
  next to a dropless scope varies token dropping (:data:`TOKEN_DROPPING`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config.recipe import KNOBS, TOKEN_DROPPING, Knob
from moe_vlm_sweep.config.schema import CudaGraphConf, DispatcherConf, RunConfig, from_dict
from moe_vlm_sweep.plan.rules import broken_rules
from moe_vlm_sweep.sweep.space import Param, Space
from moe_vlm_sweep.sweep.spec import SweepSpecError

_DROP_AND_PAD = DispatcherConf(capacity_factor=1.0, pad_to_capacity=True)


def needs_drop_and_pad(graph: CudaGraphConf) -> bool:
    """True when ``plan/rules.py`` refuses this graph scope with dropless dispatch and accepts it with
    drop-and-pad: whatever the rule, that scope trains with dropped (or padded) tokens."""
    dropless = set(broken_rules(RunConfig(cuda_graph=graph)))
    return bool(dropless - set(broken_rules(RunConfig(cuda_graph=graph, dispatcher=_DROP_AND_PAD))))


def _option(conf_dir: Path, group: str, choice: Any) -> dict[str, Any] | None:
    """The fields ``conf/<group>/<choice>.yaml`` sets (path -> value), or None if there is no such option
    (composition names that error when the trial is validated)."""
    from omegaconf import OmegaConf

    path = conf_dir / group / f"{choice}.yaml"
    if not path.is_file():
        return None
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
    assert isinstance(raw, dict)  # a config group option is a mapping
    raw.pop("defaults", None)
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(raw, f"{group}.")
    return flat


def _group_changes(param: Param, conf_dir: Path) -> set[str]:
    options = [o for o in (_option(conf_dir, param.key, c) for c in param.choices) if o is not None]
    recipe = {path for path, k in KNOBS.items() if k is Knob.RECIPE and path.startswith(param.key + ".")}
    # a field an option leaves out keeps the schema's default in that option
    varied = {path for path in recipe if len({repr(o.get(path, "<default>")) for o in options}) > 1}
    if param.key == "cuda_graph":
        graphs = [
            from_dict(CudaGraphConf, {k.split(".", 1)[1]: v for k, v in o.items() if k != "cuda_graph.name"})
            for o in options
        ]
        if len({needs_drop_and_pad(g) for g in graphs}) > 1:
            varied.add(TOKEN_DROPPING)
    return varied


def _field_changes(param: Param) -> set[str]:
    if param.key.startswith("cuda_graph."):
        field = param.key.split(".", 1)[1]
        # graphed modules matter only with graphs on: a space searching them captures (TE's graphs by default)
        graphs_on: dict[str, Any] = {"impl": "transformer_engine"} if field == "modules" else {}
        try:
            needs = {needs_drop_and_pad(CudaGraphConf(**graphs_on, **{field: _value(c)})) for c in param.choices}
        except (TypeError, ValueError):
            needs = set()
        return {TOKEN_DROPPING} if len(needs) > 1 or (needs == {True} and param.when) else set()
    if KNOBS.get(param.key) is not Knob.RECIPE:
        return set()
    single = param.kind == "categorical" and len(param.choices) == 1 and not param.when
    return (
        set() if single or (param.kind != "categorical" and param.low == param.high and not param.when) else {param.key}
    )


def _value(choice: Any) -> Any:
    """A categorical choice as the config holds it (list choices are stored as override text)."""
    import yaml

    return yaml.safe_load(choice) if isinstance(choice, str) and choice.startswith("[") else choice


def recipe_changes(space: Space, conf_dir: Path) -> dict[str, list[str]]:
    """Param key -> the recipe fields it can set to different values in different trials."""
    changes = {}
    for param in space.params:
        fields = (
            _group_changes(param, conf_dir)
            if (conf_dir / param.key).is_dir() and param.kind == "categorical"
            else _field_changes(param)
        )
        if fields:
            changes[param.key] = sorted(fields)
    return changes


def allows(allowed: Iterable[str], key: str, field: str) -> bool:
    """An entry of ``allow_recipe_changes`` names the param, the field, or a group above the field."""
    return any(entry in (key, field) or field.startswith(entry + ".") for entry in allowed)


def check_recipe(space: Space, allowed: Sequence[str], conf_dir: Path) -> dict[str, list[str]]:
    """Raise :class:`SweepSpecError` naming every param that varies a recipe field without the opt-in; return
    the allowed changes (for the sweep's opening lines)."""
    changes = recipe_changes(space, conf_dir)
    refused = {key: [f for f in fields if not allows(allowed, key, f)] for key, fields in changes.items()}
    refused = {key: fields for key, fields in refused.items() if fields}
    if refused:
        listed = "; ".join(f"sweep.params.{key} varies {', '.join(fields)}" for key, fields in refused.items())
        names = ",".join(refused)
        raise SweepSpecError(
            f"{listed}: recipe field(s), which change what is trained, not how fast (config/recipe.py). A search "
            f"keeps the recipe unless the space opts in: allow_recipe_changes: [{names}] in the space, or "
            f"sweep.allow_recipe_changes=[{names}] on the command line; each recipe is then ranked separately"
        )
    return changes
