"""Hydra composition of a RunConfig from the packaged ``conf/`` plus overrides, with errors a user can act on.

Three config roots, searched in this order: the package's own ``moe_vlm_sweep/conf`` (groups and sweep spaces),
a team's directories given as ``--config-dir DIR`` or ``hydra.searchpath=[file:///DIR]`` (their own ``model=``,
``hardware=``, ``sweep=`` files, kept outside the package), and ``<outputs_dir>/conf`` where ``moe-vlm-sweep best``
writes its ``experiment/`` configs. Nothing is ever written into the package.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from moe_vlm_sweep.config.schema import ConfigFieldError, RunConfig
from moe_vlm_sweep.config.store import register
from moe_vlm_sweep.config.typed import to_typed

CONF_DIR = Path(os.environ.get("MOE_VLM_SWEEP_CONF", Path(__file__).resolve().parent.parent / "conf"))
"""The packaged config groups (``MOE_VLM_SWEEP_CONF`` replaces the whole folder, as the tests do)."""
EXPORTS = "conf"
"""The config root inside the outputs folder that exported experiments live in (``experiment/<name>.yaml``)."""
SEARCHPATH = "hydra.searchpath"


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


def _field_type(path: str) -> Any:
    """The type of RunConfig's field at OmegaConf's ``full_key`` (``recompute.modules[0]``), with ``X | None`` and
    ``list[X]`` taken down to ``X``; None for a path that names no field."""
    hint: Any = RunConfig
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        if not dataclasses.is_dataclass(hint):
            return None
        hint = typing.get_type_hints(hint).get(part)
        while typing.get_origin(hint) in (list, typing.Union, types.UnionType):
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def choice_error(exc: BaseException | None) -> str | None:
    """OmegaConf's refusal of a value outside an Enum field, in the words of every other field error
    (``train.precision='fp16' must be one of auto, bf16, fp32, fp8``); None for any other error."""
    if not isinstance(exc, ValidationError) or not isinstance(exc.full_key, str):
        return None
    hint = _field_type(exc.full_key)
    if not (isinstance(hint, type) and issubclass(hint, enum.Enum)) or exc.value in set(hint):
        return None
    return f"{exc.full_key}={exc.value!r} must be one of {', '.join(m.value for m in hint)}"


def exports_dir(outputs_dir: str | Path) -> Path:
    """Where ``best`` writes ``experiment/<name>.yaml``; every composition searches it (:func:`with_searchpath`)."""
    return Path(outputs_dir) / EXPORTS


def _outputs_dir(parsed: Sequence[Override]) -> str:
    given = [o.value() for o in parsed if o.key_or_group == "outputs_dir" and not o.is_delete()]
    default = next(f.default for f in dataclasses.fields(RunConfig) if f.name == "outputs_dir")
    return str(given[-1] if given else default)


def _quoted(entry: str) -> str:
    return "'" + entry.replace("'", "\\'") + "'"


def _is_override(arg: str) -> bool:
    """``key=value`` rather than one of Hydra's flags (``-m``, ``--cfg job``) or a flag's value."""
    return "=" in arg and not arg.startswith("-")


def add_searchpath(args: Sequence[str], entries: Sequence[str]) -> list[str]:
    """``args`` with ``entries`` appended to the one ``hydra.searchpath=[...]`` override (made if absent);
    arguments that are not overrides stay as they are."""
    parsed = OverridesParser.create().parse_overrides([a for a in args if _is_override(a)])
    current = [o for o in parsed if o.key_or_group == SEARCHPATH]
    given = list(typing.cast("list[str]", current[-1].value())) if current else []  # the searchpath is a list
    merged = [*given, *(e for e in entries if e not in given)]
    if merged == given:
        return list(args)
    rest = [a for a in args if not (_is_override(a) and a.split("=")[0] == SEARCHPATH)]
    # Right after the last override: Hydra's argument parser takes the overrides as one contiguous run.
    at = max((i + 1 for i, a in enumerate(rest) if _is_override(a)), default=0)
    return [*rest[:at], f"{SEARCHPATH}=[{','.join(map(_quoted, merged))}]", *rest[at:]]


def config_dir_overrides(args: Sequence[str]) -> list[str]:
    """Command-line arguments with each ``--config-dir DIR`` (``--config-dir=DIR``, ``-cd DIR``) turned into a
    ``hydra.searchpath`` entry, so ``check``, ``run`` and ``run -m`` search it the same way (after the packaged
    configs) and a run's recorded overrides replay it. Raises CompositionError for a missing directory."""
    rest, dirs, args = [], [], list(args)
    while args:
        arg = args.pop(0)
        if arg in ("--config-dir", "-cd") or arg.startswith("--config-dir="):
            value = arg.partition("=")[2] if "=" in arg else (args.pop(0) if args else "")
            path = Path(value).expanduser().resolve()
            if not value or not path.is_dir():
                raise CompositionError(
                    f"--config-dir {value!r}: no such directory (it holds config groups, e.g. model/our_model.yaml)"
                )
            dirs.append(f"file://{path}")
        else:
            rest.append(arg)
    return add_searchpath(rest, dirs) if dirs else rest


def with_searchpath(args: Sequence[str]) -> list[str]:
    """``args`` with the outputs folder's exported experiments on the search path (once ``best`` made it), so
    ``+experiment=<study>_best`` composes from wherever that outputs folder is."""
    parsed = OverridesParser.create().parse_overrides([a for a in args if _is_override(a)])
    exports = exports_dir(_outputs_dir(parsed)).resolve()
    return add_searchpath(args, [f"file://{exports}"]) if exports.is_dir() else list(args)


def to_run_config(cfg: DictConfig) -> RunConfig:
    """Typed RunConfig from a composed DictConfig; each group's ``__post_init__`` runs here.

    Keys that ``+key=value`` slipped past Hydra's struct mode are rejected here.
    """
    data = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(data, dict)  # a DictConfig's container
    unknown = _unknown_keys(RunConfig, data)
    if unknown:
        raise CompositionError(
            f"unknown config key(s): {', '.join(unknown)} (see {CONF_DIR} and "
            "moe_vlm_sweep/config/schema.py for the valid ones)"
        )
    return to_typed(cfg, own_error=ConfigFieldError, wrap=lambda exc: CompositionError(choice_error(exc) or str(exc)))


def compose_config(overrides: Sequence[str] = (), *, config_name: str = "config") -> DictConfig:
    register()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="moe_vlm_sweep"):
            return compose(config_name=config_name, overrides=with_searchpath(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        cause = exc.__cause__
        choice = choice_error(cause) or choice_error(exc)
        if choice is not None:
            raise CompositionError(choice) from None
        detail = f": {cause}" if cause is not None and str(cause) not in str(exc) else ""
        raise CompositionError(f"{exc}{detail}") from None


def compose_run_config(overrides: Sequence[str] = ()) -> RunConfig:
    return to_run_config(compose_config(overrides))
