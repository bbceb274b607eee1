"""Hydra composition of a RunConfig from ``conf/`` plus overrides, with errors a user can act on."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from moe_vlm_sweep.config.schema import ConfigFieldError, RunConfig
from moe_vlm_sweep.config.store import register
from moe_vlm_sweep.config.typed import to_typed

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = Path(os.environ.get("MOE_VLM_SWEEP_CONF", Path(__file__).resolve().parents[1] / "conf"))


class CompositionError(ValueError):
    """An override names an unknown group, option or key, or a value of the wrong type."""


def _unknown_keys(schema: type, data: dict, prefix: str = "") -> list[str]:
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    unknown = [f"{prefix}{key}" for key in data if key not in fields]
    for key, value in data.items():
        if key in fields and dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            unknown += _unknown_keys(hints[key], value, f"{prefix}{key}.")
    return unknown


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed RunConfig from a composed DictConfig; each group's ``__post_init__`` runs here.

    Keys that ``+key=value`` slipped past Hydra's struct mode are rejected here.
    """
    unknown = _unknown_keys(RunConfig, OmegaConf.to_container(cfg, resolve=False))
    if unknown:
        raise CompositionError(f"unknown config key(s): {', '.join(unknown)} (see conf/ and "
                               "moe_vlm_sweep/config/schema.py for the valid ones)")
    return to_typed(cfg, own_error=ConfigFieldError, wrap=lambda exc: CompositionError(str(exc)))


def compose_config(overrides: Sequence[str] = (), *, config_name: str = "config") -> DictConfig:
    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="moe_vlm_sweep"):
            return compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__
        detail = f": {cause}" if cause is not None and str(cause) not in str(exc) else ""
        raise CompositionError(f"{exc}{detail}") from None


def compose_run_config(overrides: Sequence[str] = ()) -> RunConfig:
    return to_run_config(compose_config(overrides))
