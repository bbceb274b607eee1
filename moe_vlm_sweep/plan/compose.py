"""Hydra overrides -> validated RunPlan: the one path ``check``, ``run``, a sweep's trial and a confirmation
re-run all take, so a config valid for one is valid for all and each records the same resolved files.

Kept apart from ``plan/plan.py`` because it imports Hydra, which the training worker (a reader of plans) never
does.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from moe_vlm_sweep.config.compose import CompositionError, compose_config, to_run_config
from moe_vlm_sweep.config.schema import ConfigFieldError
from moe_vlm_sweep.plan.plan import RunPlan, make_plan
from moe_vlm_sweep.plan.rules import ConfigError

INVALID_ERRORS = (CompositionError, ConfigFieldError, ConfigError)
"""What invalid user input raises on the way to a plan (each message names the knob, the value and the rule)."""


def plan_of(composed: DictConfig, overrides: Sequence[str]) -> tuple[RunPlan, str]:
    """(plan, resolved YAML) of a config Hydra already composed from ``overrides`` (a sweep's trial); raises
    one of :data:`INVALID_ERRORS` with every reason."""
    return make_plan(to_run_config(composed), list(overrides)), OmegaConf.to_yaml(composed)


def compose_plan(overrides: Sequence[str]) -> tuple[RunPlan, str]:
    """(plan, resolved YAML) from Hydra overrides, composed from the packaged ``conf/`` (``moe-vlm-sweep run``);
    raises one of :data:`INVALID_ERRORS` with every reason."""
    return plan_of(compose_config(overrides), overrides)
