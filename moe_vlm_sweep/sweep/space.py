"""Search spaces a person writes in YAML, turned into Optuna suggestions and Hydra overrides.

A space maps a Hydra override key to a distribution::

    batch.mbs: [1, 2, 4]                                    # categorical (shorthand)
    recompute: {type: categorical, choices: [none, selective]}
    recompute.modules:                                      # conditional: sampled only when the condition holds
      {type: categorical, choices: [[core_attn], [core_attn, moe]], when: {recompute: selective}}
    parallel.etp: {type: int, low: 1, high: 4, log: true, when: {parallel.ep: ">1"}}
    train.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}

Conditions name params listed earlier (so the sampler sees them first) and compare with ``==`` (a plain value),
``in`` (a list) or an operator prefix (``">1"``, ``"!=none"``). A knob left out of a trial keeps the value its
config group gives it, which is what makes ``parallel.tp`` meaningless (and unsampled) under ``parallel=fsdp``.
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from moe_vlm_sweep.sweep.spec import SweepSpecError

_OPS = {">=": operator.ge, "<=": operator.le, "!=": operator.ne, "==": operator.eq, ">": operator.gt, "<": operator.lt}
_PLAIN = re.compile(r"^[\w./@:-]+$")


def format_value(value: Any) -> str:
    """A Python value as Hydra override text (``[core_attn,moe]``, ``true``, ``null``, ``'a b'``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if isinstance(value, str) and not _PLAIN.match(value):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


@dataclass(frozen=True)
class Condition:
    key: str
    op: str
    value: Any

    def holds(self, sampled: Mapping[str, Any]) -> bool:
        if self.key not in sampled:
            return False
        actual = sampled[self.key]
        if self.op == "in":
            return actual in self.value
        try:
            return bool(_OPS[self.op](actual, self.value))
        except TypeError:
            return False

    def __str__(self) -> str:
        return f"{self.key} {self.op} {self.value!r}"


@dataclass(frozen=True)
class Param:
    key: str
    kind: str
    """categorical | int | float"""
    choices: tuple = ()
    """Categorical choices as Optuna stores them: scalars as they are, lists as their override text."""
    low: float = 0
    high: float = 0
    step: float | None = None
    log: bool = False
    when: tuple[Condition, ...] = ()

    def suggest(self, trial: Any) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)

    def alternatives(self, value: Any) -> list[Any]:
        """The values one move from ``value``: every other choice; an int's next step either way (doubled or
        halved on a log scale); none for a continuous float."""
        if self.kind == "categorical":
            return [c for c in self.choices if c != value]
        if self.kind == "float" and self.step is None:
            return []
        if self.log:
            moves = [value // 2, value * 2]
        else:
            step = self.step or 1
            moves = [value - step, value + step]
        return [v for v in moves if self.low <= v <= self.high and v != value]


def _condition(param: str, key: str, raw: Any, earlier: Sequence[str]) -> Condition:
    if key not in earlier:
        raise SweepSpecError(
            f"sweep.params.{param}.when names {key!r}, which is not a param listed before "
            f"{param} (known: {', '.join(earlier) or 'none'})"
        )
    if isinstance(raw, (list, tuple)):
        return Condition(key, "in", tuple(_choice(v) for v in raw))
    if isinstance(raw, str):
        for op in _OPS:
            if raw.startswith(op):
                return Condition(key, op, yaml.safe_load(raw[len(op) :].strip()))
    return Condition(key, "==", _choice(raw))


def _choice(value: Any) -> Any:
    """Optuna's categorical choices must be scalars: a list choice (``[core_attn]``) is kept as override text."""
    if isinstance(value, (list, tuple, dict)):
        return format_value(list(value) if not isinstance(value, dict) else value)
    return value


def _number(param: str, spec: Mapping[str, Any], name: str) -> float:
    value = spec.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise SweepSpecError(f"sweep.params.{param}.{name}={value!r} must be a number")
    return value


_FIELDS = {"categorical": ("choices",), "int": ("low", "high", "step", "log"), "float": ("low", "high", "step", "log")}
"""The fields each param type takes besides ``type`` and ``when``."""


def parse_param(key: str, raw: Any, earlier: Sequence[str]) -> Param:
    spec: dict[str, Any] = (
        {"type": "categorical", "choices": list(raw)} if isinstance(raw, (list, tuple)) else dict(raw or {})
    )
    kind = spec.pop("type", None)
    when = tuple(_condition(key, k, v, earlier) for k, v in dict(spec.pop("when", None) or {}).items())
    allowed = _FIELDS.get(kind)
    unknown = sorted(set(spec) - set(allowed or ()))
    if allowed is not None and unknown:  # before any missing field: a misspelled one is why it is missing
        raise SweepSpecError(
            f"sweep.params.{key}: unknown field(s) {', '.join(map(str, unknown))} for type {kind} "
            f"(allowed: type, when, {', '.join(allowed)})"
        )
    if kind == "categorical":
        choices = spec.pop("choices", None)
        if not choices:
            raise SweepSpecError(f"sweep.params.{key}.choices must list at least one value")
        param = Param(key, kind, choices=tuple(_choice(c) for c in choices), when=when)
    elif kind in ("int", "float"):
        low, high = _number(key, spec, "low"), _number(key, spec, "high")
        step, log = spec.pop("step", None), bool(spec.pop("log", False))
        spec.pop("low"), spec.pop("high")
        if low > high:
            raise SweepSpecError(f"sweep.params.{key}.low={low} must be <= high={high}")
        if log and (low <= 0 or step not in (None, 1)):
            raise SweepSpecError(f"sweep.params.{key}: log=true needs low > 0 (got {low}) and no step (got {step})")
        if kind == "int" and any(isinstance(v, float) and not float(v).is_integer() for v in (low, high, step or 1)):
            raise SweepSpecError(f"sweep.params.{key}: type int needs integer low/high/step")
        param = Param(key, kind, low=low, high=high, step=step, log=log, when=when)
    else:
        raise SweepSpecError(
            f"sweep.params.{key}.type={kind!r} must be categorical, int or float (or give a list of choices)"
        )
    return param


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]

    @classmethod
    def parse(cls, raw: Mapping[str, Any], fixed_keys: Sequence[str] = ()) -> Space:
        params: list[Param] = []
        for key, spec in raw.items():
            if key in fixed_keys:
                raise SweepSpecError(
                    f"sweep.params.{key} is also set by a fixed override (sweep.fixed or the "
                    "command line); search it or fix it, not both"
                )
            params.append(parse_param(str(key), spec, [p.key for p in params]))
        return cls(tuple(params))

    def point(self, values: Mapping[str, Any], where: str) -> dict[str, Any]:
        """A config named by hand (``sweep.first_trials``) as Optuna stores its params, checked against the space
        so a typo fails before the study is touched. Params left out are sampled as usual."""
        params = {p.key: p for p in self.params}
        point: dict[str, Any] = {}
        for key, value in values.items():
            param = params.get(key)
            if param is None:
                raise SweepSpecError(f"{where}.{key}: not a param of sweep.params (searched: {', '.join(params)})")
            stored = _choice(value)
            if param.kind == "categorical" and stored not in param.choices:
                raise SweepSpecError(
                    f"{where}.{key}={format_value(value)} is not one of sweep.params.{key}.choices "
                    f"[{', '.join(format_value(c) for c in param.choices)}]"
                )
            if param.kind != "categorical" and not param.low <= value <= param.high:
                raise SweepSpecError(f"{where}.{key}={value} is outside sweep.params.{key} [{param.low}, {param.high}]")
            point[key] = stored
        for param in self.params:
            if param.key in point and not all(c.holds(point) for c in param.when):
                raise SweepSpecError(
                    f"{where}.{param.key} is given, but in this config its condition "
                    f"({' and '.join(map(str, param.when))}) does not hold, so it is never sampled"
                )
        return point

    def suggest(self, trial: Any) -> dict[str, Any]:
        """Sample every param whose conditions hold, in order; returns key -> value as Optuna stores it."""
        sampled: dict[str, Any] = {}
        for param in self.params:
            if all(c.holds(sampled) for c in param.when):
                sampled[param.key] = param.suggest(trial)
        return sampled

    def neighbors(self, point: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The configs one knob away from ``point``, as a performance engineer walks out from a best config. A param
        whose condition stops holding is dropped; one whose condition starts to hold is left out, for the sampler
        to fill in."""
        found = []
        for param in self.params:
            if param.key not in point:
                continue
            for value in param.alternatives(point[param.key]):
                moved, kept = {**point, param.key: value}, dict[str, Any]()
                for p in self.params:
                    if p.key in moved and all(c.holds(kept) for c in p.when):
                        kept[p.key] = moved[p.key]
                found.append(kept)
        return found

    @staticmethod
    def overrides(sampled: Mapping[str, Any]) -> list[str]:
        return [
            f"{key}={value if isinstance(value, str) and value.startswith('[') else format_value(value)}"
            for key, value in sampled.items()
        ]


def fixed_overrides(fixed: Mapping[str, Any]) -> list[str]:
    """``sweep.fixed`` (key -> value) as the override strings every trial gets, rendered like sampled values: the
    one rendering, since these exact strings (``model=small``, ``fusions.bias_activation=true``) are hashed into
    the study name."""
    return Space.overrides(fixed)


def fingerprint(*parts: Any) -> str:
    """A short stable hash of plain data: the same space + fixed overrides + objective give the same study."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:8]
