"""A sweep's space checked before any trial runs, so a typo costs one second, not a study.

Sampling finds a bad space late: a misspelled knob (``batch.mbss``) makes every trial invalid, a choice of the
wrong type (``batch.mbs: [1, two]``) fails only when drawn, and an objective that is not a field of
``metrics.json`` fails after a whole trial has trained. Here every value a trial could get is composed once
(each categorical choice, each int/float bound, each ``first_trials`` entry, the fixed overrides alone) and the
objective is looked up in the :class:`~moe_vlm_sweep.metrics.schema.Metrics` dataclass. Composition is Hydra's
(unknown keys, unknown group options, the typed fields' conversions); the plan's rules are not applied here,
since a value that breaks one only in some combinations is a trial the sampler learns to avoid.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from moe_vlm_sweep.config.compose import choice_error
from moe_vlm_sweep.metrics.schema import Metrics
from moe_vlm_sweep.sweep.space import Param, Space, format_value
from moe_vlm_sweep.sweep.spec import ObjectiveConf, SweepSpecError

Compose = Callable[[list[str]], Any]
"""overrides -> composed config; raises Hydra's or OmegaConf's error for a value that does not compose."""
_COMPOSE_ERRORS = (HydraException, OmegaConfBaseException)


def _is_number(tp: Any) -> bool:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return len(args) == 1 and _is_number(args[0])
    return tp in (int, float)


def metric_fields(tp: Any = Metrics, prefix: str = "") -> Iterator[str]:
    """The numeric fields of ``metrics.json``, dotted (``step_time_s.median``; ``KEY`` where a mapping's key is
    free, as in ``wall_s.KEY``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if _is_number(tp):
        yield prefix.rstrip(".")
    elif dataclasses.is_dataclass(tp):
        for name, hint in typing.get_type_hints(tp).items():
            yield from metric_fields(hint, f"{prefix}{name}.")
    elif typing.get_origin(tp) is dict:
        yield from metric_fields(typing.get_args(tp)[1], f"{prefix}KEY.")


def check_objective(objective: ObjectiveConf) -> None:
    fields = list(metric_fields())
    for name in objective.metrics:
        parts = name.split(".")
        if not any(
            len(f.split(".")) == len(parts) and all(a in (b, "KEY") for a, b in zip(f.split("."), parts))
            for f in fields
        ):
            top = sorted(f for f in fields if "." not in f)
            raise SweepSpecError(
                f"sweep.objective.metric={name!r} is not a numeric field of metrics.json (the "
                f"Metrics dataclass, moe_vlm_sweep/metrics/schema.py); top-level ones: "
                f"{', '.join(top)}"
            )


def _reason(exc: BaseException) -> str:
    """Hydra's message without its hint to append with ``+`` (a misspelled knob wants fixing, not adding), with
    the cause (``Key 'mbss' not in 'BatchConf'``, ``Value 'two' ... could not be converted to Integer``); a value
    outside a closed choice in the config's own words."""
    choice = choice_error(exc.__cause__) or choice_error(exc)
    if choice is not None:
        return choice
    lines = [
        line.strip()
        for line in str(exc).strip().splitlines()
        if line.strip() and not line.strip().startswith(("To append", "Config search path", "provider="))
    ]
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        lines.append(str(cause).strip().splitlines()[0])
    return " ".join(lines[:8])[:600]


def _values(param: Param) -> list[Any]:
    if param.kind == "categorical":
        return list(param.choices)
    low, high = (int(param.low), int(param.high)) if param.kind == "int" else (param.low, param.high)
    return [low] if low == high else [low, high]


def _given(param: Param) -> dict[str, Any]:
    """Values of the earlier params its conditions ask for (``==`` and ``in``), so it composes as it is sampled."""
    given: dict[str, Any] = {}
    for condition in param.when:
        if condition.op == "==":
            given[condition.key] = condition.value
        elif condition.op == "in" and condition.value:
            given[condition.key] = condition.value[0]
    return given


def check_space(compose: Compose, space: Space, base: Sequence[str], first_trials: Sequence[Mapping[str, Any]]) -> int:
    """Compose every value of the space over ``base``; raise SweepSpecError naming the first that fails. Returns
    how many configs were composed."""

    def attempt(extra: Mapping[str, Any], what: str) -> None:
        try:
            compose([*base, *Space.overrides(extra)])
        except _COMPOSE_ERRORS as exc:
            raise SweepSpecError(f"{what} does not compose: {_reason(exc)}") from None

    attempt({}, "sweep.fixed with the command line's overrides")
    count = 1
    for param in space.params:
        for value in _values(param):
            attempt(
                {**_given(param), param.key: value},
                f"sweep.params.{param.key}={value if isinstance(value, str) else format_value(value)}",
            )
            count += 1
    for index, point in enumerate(first_trials):
        attempt(point, f"sweep.first_trials[{index}]")
        count += 1
    return count
