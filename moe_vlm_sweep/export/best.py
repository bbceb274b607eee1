"""Rank a study's trials and write the winners so ``moe-vlm-sweep run +experiment=<name>`` replays them.

Each trial stores the exact overrides it ran with (user attr ``overrides``: the fixed ones plus the sampled
ones, what ``plan.overrides`` held). The export turns them into three equivalent forms: an override file, an
experiment config (``<outputs>/conf/experiment/<name>.yaml``, on every composition's search path;
``# @package _global_``, group choices as ``override /group: option`` and field values as YAML), and the command
line. Nothing is written into the package. Results of different data realism
are never ranked together: a study holding more than one refuses, naming the counts. Nor are trials of different
recipes (``export/recipes.py``): one recipe is ranked, the baseline's unless another is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.config.compose import CONF_DIR
from moe_vlm_sweep.export import recipes
from moe_vlm_sweep.launch.run_dir import overrides_yaml, rerun_command, write_atomic
from moe_vlm_sweep.sweep.trial import CONTENDED_ATTR, is_contended


class ExportError(ValueError):
    """The study cannot be ranked or exported as asked; the message says why and what to do."""


@dataclass(frozen=True)
class Exported:
    rank: int
    trial: FrozenTrial
    experiment: str
    overrides: list[str]

    @property
    def command(self) -> str:
        return f"moe-vlm-sweep run +experiment={self.experiment}"


def realism_of(trials: Sequence[FrozenTrial]) -> str | None:
    """The one data realism of ``trials``; raises ExportError if they mix several."""
    counts: dict[str, int] = {}
    for trial in trials:
        realism = trial.user_attrs.get("data_realism", "unknown")
        counts[realism] = counts.get(realism, 0) + 1
    if len(counts) > 1:
        listed = ", ".join(f"{n} trial(s) {r}" for r, n in sorted(counts.items()))
        raise ExportError(
            f"the study mixes data realism ({listed}); results of different realism are not "
            "comparable: rank one realism per study (set data= in sweep.fixed)"
        )
    return next(iter(counts), None)


def ranked(study: optuna.Study, recipe: str | None = None) -> list[FrozenTrial]:
    """Completed trials of one recipe (``recipe``, else the baseline's: ``export/recipes.py``) best first; with
    two objectives, their Pareto front ordered by the first objective. Uncontended trials come first."""
    complete = recipes.keep(
        study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), recipes.chosen(study, recipe)
    )
    if len(study.directions) > 1:
        complete = recipes.pareto(complete, study) if complete else []
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    # A trial measured beside another process (metrics.json's ``contended``) is not the config's own speed: it
    # never outranks an uncontended one; tables mark it.
    return sorted(complete, key=lambda t: (is_contended(t), sign * t.values[0], t.number))


def experiment_yaml(overrides: Sequence[str], conf_dir: Path = CONF_DIR, *, header: str = "") -> str:
    """An experiment config equivalent to ``overrides`` (group choices first, then field values); a key is a
    group choice when ``conf_dir`` (the packaged configs) has a folder of that name."""
    defaults: list[dict[str, str]] = []
    values: dict[str, Any] = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group
        if override.is_delete() or override.is_sweep_override():
            raise ExportError(f"override {override.input_line!r} cannot go into an experiment config")
        if (conf_dir / key).is_dir():
            defaults.append({f"override /{key}": override.get_value_element_as_str()})
            continue
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = override.value()
    body = yaml.safe_dump({**({"defaults": defaults} if defaults else {}), **values}, sort_keys=False)
    return f"# @package _global_\n{header}{body}"


def export(
    study: optuna.Study,
    *,
    sweep_dir: Path,
    conf_dir: Path,
    top_k: int,
    confirmed: FrozenTrial | None = None,
    recipe: str | None = None,
) -> list[Exported]:
    """Write the top ``top_k`` trials (experiment configs, override files, commands); return them.

    ``conf_dir``: the config root the experiments go into (``config.compose.exports_dir`` of the outputs
    folder), as ``experiment/<name>.yaml``.
    ``confirmed``: the trial that held in confirmation re-runs (``export.confirm``); it becomes rank 1, so
    ``<study>_best``, ``overrides.yaml`` and ``command.sh`` replay it, and the others keep the study's order.
    """
    realism = realism_of(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    top = ranked(study, recipe)
    if confirmed is not None:
        if confirmed.number not in {t.number for t in top}:
            raise ExportError(f"trial #{confirmed.number} is not a ranked (completed) trial of {study.study_name}")
        top = [confirmed, *(t for t in top if t.number != confirmed.number)]
    top = top[:top_k]
    out = sweep_dir / "best"
    out.mkdir(parents=True, exist_ok=True)
    (conf_dir / "experiment").mkdir(parents=True, exist_ok=True)
    exported = []
    for rank, trial in enumerate(top, 1):
        name = f"{study.study_name}_best" if rank == 1 else f"{study.study_name}_t{trial.number}"
        overrides = list(trial.user_attrs.get("overrides", []))
        held = " after confirmation re-runs, see best/confirm.json" if trial is confirmed else ""
        shared = (
            f"# Contended: measured beside {trial.user_attrs[CONTENDED_ATTR]}; its values are not the config's own.\n"
            if is_contended(trial)
            else ""
        )
        header = (
            f"# Trial #{trial.number} of study {study.study_name} (rank {rank}{held}, values {trial.values}, "
            f"data realism {realism}).\n{shared}# Run it: moe-vlm-sweep run +experiment={name}\n"
        )
        write_atomic(conf_dir / "experiment" / f"{name}.yaml", experiment_yaml(overrides, header=header))
        exported.append(Exported(rank=rank, trial=trial, experiment=name, overrides=overrides))
    kept = {f"{e.experiment}.yaml" for e in exported}
    for stale in (conf_dir / "experiment").glob(f"{study.study_name}_t*.yaml"):
        if stale.name not in kept:  # a runner-up of an earlier export that this one no longer ranks
            stale.unlink()
    if exported:
        best = exported[0]
        write_atomic(out / "overrides.yaml", overrides_yaml(best.overrides))
        write_atomic(
            out / "command.sh",
            f"#!/bin/sh\n# Best trial #{best.trial.number} of {study.study_name}.\n"
            f"{best.command}\n# equivalently:\n# {rerun_command(best.overrides)}\n",
        )
        summary = [
            {
                "rank": e.rank,
                "trial": e.trial.number,
                "values": list(e.trial.values),
                "data_realism": realism,
                "recipe": e.trial.user_attrs.get("recipe"),
                "experiment": e.experiment,
                "command": e.command,
                "overrides": e.overrides,
                "run_dir": e.trial.user_attrs.get("run_dir"),
                "confirmed": e.trial is confirmed,
                "contended": e.trial.user_attrs.get(CONTENDED_ATTR),
            }
            for e in exported
        ]
        write_atomic(out / "top.yaml", yaml.safe_dump(summary, sort_keys=False))
    return exported


def confirmed_export(sweep_dir: Path) -> int | None:
    """The trial an earlier export wrote as ``<study>_best`` after it held in confirmation re-runs, if any: an
    unconfirmed export must not replace it (``best/top.yaml``). None when nothing was exported yet or the export
    was unconfirmed. A ``top.yaml`` that exists but cannot be read may name a confirmed best, so it is not taken
    for "none": ExportError, and the caller exports nothing over it."""
    path = sweep_dir / "best" / "top.yaml"
    try:
        top = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ExportError(_unreadable(path, f"{type(exc).__name__}: {' '.join(str(exc).split())}")) from exc
    if top is None or top == []:
        return None
    if not (isinstance(top, list) and isinstance(top[0], dict) and isinstance(top[0].get("trial"), int)):
        raise ExportError(_unreadable(path, "it is not the list of ranked trials an export writes"))
    return top[0]["trial"] if top[0].get("confirmed") else None


def _unreadable(path: Path, why: str) -> str:
    return (
        f"{path} cannot be read ({why}); it may hold a confirmed best that an unconfirmed export must not replace, "
        "so nothing is exported over it. Restore or delete it, then export with moe-vlm-sweep best"
    )
