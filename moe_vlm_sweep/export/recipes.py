"""Rank within one recipe: trials that train different models are never ranked against each other.

Each trial of a sweep carries its recipe fingerprint (user attrs ``recipe`` and ``recipe_differs``, from its
plan: ``config/recipe.py``). A study whose space varies a recipe field (allowed by ``allow_recipe_changes``)
holds several; ``best``, the export and the confirmation then rank the trials of one recipe, the baseline's
(the first trial that has one: trial #0, the space's first ``first_trials`` entry, is the reference) or the one
named with ``--recipe``, and list the others apart with what differs. Trials recorded before fingerprints
existed have none and rank together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from moe_vlm_sweep.config.recipe import between


class RecipeError(ValueError):
    """``--recipe`` names no recipe of the study."""


def recipe_of(trial: FrozenTrial) -> str | None:
    return trial.user_attrs.get("recipe")


def fingerprints(study: optuna.Study) -> list[str]:
    """The study's recipes in the order their first trial was asked."""
    seen: list[str] = []
    for trial in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        recipe = recipe_of(trial)
        if recipe is not None and recipe not in seen:
            seen.append(recipe)
    return seen


def chosen(study: optuna.Study, recipe: str | None = None) -> str | None:
    """``recipe`` (checked) or the baseline's; None for a study without fingerprints."""
    known = fingerprints(study)
    if recipe is not None:
        if recipe not in known:
            raise RecipeError(
                f"--recipe {recipe} is not a recipe of study {study.study_name} "
                f"(it has: {', '.join(known) or 'none recorded'})"
            )
        return recipe
    return known[0] if known else None


def keep(trials: Sequence[FrozenTrial], recipe: str | None) -> list[FrozenTrial]:
    return [t for t in trials if recipe is None or recipe_of(t) == recipe]


def pareto(trials: Sequence[FrozenTrial], study: optuna.Study) -> list[FrozenTrial]:
    """The Pareto front of ``trials`` alone (a front over all recipes would let one recipe hide another's)."""
    from optuna.study._multi_objective import _get_pareto_front_trials_by_trials

    return _get_pareto_front_trials_by_trials(list(trials), study.directions)


@dataclass(frozen=True)
class OtherRecipe:
    fingerprint: str
    trials: list[FrozenTrial]
    """Its completed trials."""
    differs: dict[str, Any]
    """Fields where it differs from the ranked recipe."""


def others(study: optuna.Study, recipe: str | None) -> list[OtherRecipe]:
    """The recipes besides ``recipe``, each with its completed trials and what differs."""
    if recipe is None:
        return []
    trials = study.get_trials(deepcopy=False)
    base: dict[str, Any] = next((t.user_attrs.get("recipe_differs", {}) for t in trials if recipe_of(t) == recipe), {})
    found = []
    for fingerprint in fingerprints(study):
        if fingerprint == recipe:
            continue
        mine = [t for t in trials if recipe_of(t) == fingerprint]
        found.append(
            OtherRecipe(
                fingerprint=fingerprint,
                trials=[t for t in mine if t.state == TrialState.COMPLETE],
                differs=between(mine[0].user_attrs.get("recipe_differs", {}), base),
            )
        )
    return found


def note(study: optuna.Study, recipe: str | None, *, explicit: bool = False) -> str:
    """Empty for a study of one recipe; else what is ranked and each other recipe's best, apart."""
    rest = others(study, recipe)
    if not rest:
        return ""
    sign = -1.0 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else 1.0
    why = "named with --recipe" if explicit else "the baseline's: the study's first trial"
    lines = [
        f"recipes: the study holds {len(rest) + 1} recipes (they train different models); ranked: {recipe} "
        f"({why}). Ranked apart, never against it:"
    ]
    for other in rest:
        top = min(other.trials, key=lambda t: (sign * t.values[0], t.number)) if other.trials else None
        best = f"best trial #{top.number} ({top.values[0]:.4g})" if top else "no completed trial"
        diff = ", ".join(f"{k}={v}" for k, v in other.differs.items())
        lines.append(
            f"  recipe {other.fingerprint}: {len(other.trials)} completed trial(s), {best}; differs: {diff}"
            f"  (moe-vlm-sweep best {study.study_name} --recipe {other.fingerprint})"
        )
    return "\n".join(lines)
