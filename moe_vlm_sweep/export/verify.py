"""Does a faster config train the same model? Compare its loss and gradient-norm curves with its reference's.

A performance knob (layout, micro-batch size, recompute, graphs, fusions) may change the order of floating-point
reductions and nothing else; a recipe change (dropped tokens, a frozen encoder, a lost mask) changes the loss
from the first step. So the candidate and the reference train ``steps`` steps from the same seeds on the same
batches (each synthetic sample is drawn by its index in the global batch, so any layout sees the same samples
per step: ``data/synthetic.py``), and their per-step losses and gradient norms (``metrics.json``:
``loss.values``, ``loss.grad_norms``) are compared. The gradient norm catches what the loss hides: a gradient
counted twice (a weight-gradient fusion gone wrong) doubles it, while Adam's update and clipping barely move the
loss.

How the tolerance is measured, not guessed: the reference is trained a second time with its micro-batches split
differently (the candidate's ``batch.mbs`` if it differs, else half or twice the reference's), a change that
keeps the model, the data and the optimizer and moves only what a performance knob may move: the order of
reductions and the per-micro-batch statistics of the MoE load-balancing loss. Its per-step spread
``|ref'(s) - ref(s)|`` gives the envelope ``E(s) = max over t <= s`` (noise grows as training goes on, it does
not shrink back), and the candidate passes when, at every step and for each of the two series,

    |cand(s) - ref(s)| <= HEADROOM * E(s) + RESOLUTION * |ref(s)|

``HEADROOM`` (4) leaves room for a candidate that changes several performance knobs at once, each adding noise
of that kind; ``RESOLUTION`` (16 float32 ulps of the value) is the floor when the two reference runs agree bit
for bit (no other split is valid). Measured on the tiny CPU model (gbs 4, mbs 2 against mbs 1, 10 steps): the
loss's spread is 2e-7 at step 0 (the same forward; only the aux loss's gradient differs) and 1.5e-4 by step 9; a
TP=2+SP run deviates from its FSDP reference by at most 3e-7, and drop-and-pad dispatch (capacity factor 1.0)
by 4.5e-4 at step 0 already, 35 times the tolerance there.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config import recipe as recipes
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare, write_json_atomic
from moe_vlm_sweep.metrics.schema import Loss
from moe_vlm_sweep.plan.compose import compose_plan
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep.trial import INVALID_ERRORS

log = logging.getLogger(__name__)

DEFAULT_STEPS = 30
HEADROOM = 4.0
RESOLUTION = 16 * 2.0**-23
"""16 ulps of a float32 value (the loss, the gradient norm), relative."""
VERIFY_FILE = "verify.json"
VERIFY_SCHEMA_VERSION = 2
"""2: one record per series (``loss``, ``grad_norm``); 1 had the loss's fields at the top level."""

PlanFn = Callable[[list[str]], tuple[RunPlan, str]]


class VerifyError(ValueError):
    """The two configs cannot be compared as asked (invalid config, no reference); exits 2."""


@dataclass(kw_only=True)
class CurveCheck:
    """One per-step series of the three runs held to its tolerance: the loss, or the gradient norm."""

    reference: list[float]
    perturbed: list[float]
    candidate: list[float]
    tolerance: list[float]
    steps: list[int]
    """The steps compared: all of them for the loss; for the gradient norm, those where all three runs have one."""
    max_deviation: float
    """The largest ``|cand(s) - ref(s)|``."""
    max_deviation_step: int
    worst_step: int
    """The step whose deviation is the largest share of its tolerance."""
    worst_ratio: float
    """Deviation / tolerance at ``worst_step``: above 1 fails."""

    @property
    def passed(self) -> bool:
        return self.worst_ratio <= 1.0

    def line(self, name: str) -> str:
        at = self.steps.index(self.worst_step)
        return (
            f"largest {name} deviation {self.max_deviation:.3g} at step {self.max_deviation_step}; nearest its "
            f"tolerance at step {self.worst_step}, {self.worst_ratio:.2g} x the tolerance {self.tolerance[at]:.3g} there"
        )


@dataclass(kw_only=True)
class Verdict:
    status: str
    """``pass``, ``fail`` (a step's loss or gradient norm is outside its tolerance) or ``error`` (a run failed:
    ``reason``)."""
    steps: int
    reason: str = ""
    loss: CurveCheck | None = None
    grad_norm: CurveCheck | None = None
    """None where no step has a gradient norm in all three runs (the optimizer reported none)."""
    perturbation: str = ""
    """How the reference was re-run to measure the tolerance."""
    recipes: dict[str, Any] = field(default_factory=dict)
    """``reference``/``candidate`` -> plan.json's recipe (fingerprint, differs)."""
    run_dirs: dict[str, str | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def curves(self) -> dict[str, CurveCheck]:
        """The series compared, by name."""
        named = {"loss": self.loss, "gradient norm": self.grad_norm}
        return {name: check for name, check in named.items() if check is not None}

    def summary(self) -> str:
        if self.status == "error":
            return f"verify: ERROR: {self.reason}"
        assert self.loss is not None  # every verdict but an error has compared the curves
        ref, cand = self.recipes.get("reference", {}), self.recipes.get("candidate", {})
        failing = [name for name, check in self.curves().items() if not check.passed]
        lines = [
            f"verify: {self.status.upper()} over {self.steps} steps"
            + (f" ({' and '.join(failing)} outside the tolerance)" if failing else "")
            + f": {self.loss.line('loss')}",
            f"  gradient norm: {self.grad_norm.line('gradient norm')}"
            if self.grad_norm is not None
            else "  gradient norm: not compared (no step has one in all three runs)",
            f"  tolerance: {HEADROOM:g} x the reference's spread against itself ({self.perturbation}), "
            f"at least {RESOLUTION:.2g} x the value",
        ]
        if ref.get("fingerprint") != cand.get("fingerprint"):
            diff = recipes.describe(recipes.between(cand.get("differs", {}), ref.get("differs", {})))
            lines.append(
                f"  recipes differ: candidate {cand.get('fingerprint')} vs reference {ref.get('fingerprint')}: {diff}"
            )
        return "\n".join(lines)


def check_curve(
    reference: Sequence[float], perturbed: Sequence[float], candidate: Sequence[float], steps: Sequence[int] = ()
) -> CurveCheck:
    """Three series of equal length held to the envelope tolerance of the module's docstring; ``steps`` names
    their steps (default ``0, 1, ...``)."""
    if not len(reference) == len(perturbed) == len(candidate) > 0:
        raise ValueError(f"curves of {len(reference)}, {len(perturbed)} and {len(candidate)} steps")
    named = list(steps) or list(range(len(reference)))
    envelope, tolerance, ratios = 0.0, [], []
    for ref, pert, cand in zip(reference, perturbed, candidate):
        envelope = max(envelope, abs(pert - ref))
        tolerance.append(HEADROOM * envelope + RESOLUTION * abs(ref))
        ratio = abs(cand - ref) / tolerance[-1] if tolerance[-1] else (0.0 if cand == ref else math.inf)
        # a value that is not finite in any of the three runs fails the step: max() and the envelope would
        # otherwise pass over a NaN
        finite = all(math.isfinite(v) for v in (ref, pert, cand, ratio))
        ratios.append(ratio if finite else math.inf)
    deviations = [d if math.isfinite(d := abs(c - r)) else math.inf for r, c in zip(reference, candidate)]
    top = max(range(len(deviations)), key=deviations.__getitem__)
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return CurveCheck(
        reference=list(reference),
        perturbed=list(perturbed),
        candidate=list(candidate),
        tolerance=tolerance,
        steps=named,
        max_deviation=deviations[top],
        max_deviation_step=named[top],
        worst_step=named[worst],
        worst_ratio=ratios[worst],
    )


def _at(values: Sequence[float | None], steps: Sequence[int]) -> list[float]:
    return [value for step in steps if (value := values[step]) is not None]


def compare(runs: Mapping[str, Loss]) -> Verdict:
    """The verdict on the ``reference``, ``perturbed`` and ``candidate`` runs' loss records: their losses at every
    step, and their gradient norms at the steps where all three have one."""
    names = ("reference", "perturbed", "candidate")
    ref, pert, cand = (runs[name] for name in names)
    loss = check_curve(ref.values, pert.values, cand.values)
    norms = (ref.grad_norms, pert.grad_norms, cand.grad_norms)
    both = [s for s in loss.steps if all(s < len(n) and n[s] is not None for n in norms)]
    grad_norm = (
        check_curve(_at(ref.grad_norms, both), _at(pert.grad_norms, both), _at(cand.grad_norms, both), both)
        if both
        else None
    )
    passed = loss.passed and (grad_norm is None or grad_norm.passed)
    return Verdict(status="pass" if passed else "fail", steps=len(loss.steps), loss=loss, grad_norm=grad_norm)


def record(verdict: Verdict, reference: Sequence[str], candidate: Sequence[str]) -> dict[str, Any]:
    """``verify.json``: the verdict, its tolerance's constants and both configs. Strict JSON, so any reader (jq,
    a browser) takes it: a value that is not a finite number (a NaN loss, the ratio over a zero tolerance) is
    ``null``, and each series says whether it ``passed``."""
    data = asdict(verdict)
    for key, check in (("loss", verdict.loss), ("grad_norm", verdict.grad_norm)):
        if check is not None:
            data[key]["passed"] = check.passed
    return _finite_or_null(
        {
            "schema_version": VERIFY_SCHEMA_VERSION,
            **data,
            "headroom": HEADROOM,
            "resolution": RESOLUTION,
            "overrides": {"reference": list(reference), "candidate": list(candidate)},
        }
    )


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_or_null(item) for item in value]
    return value


def run_overrides(overrides: Sequence[str], steps: int) -> list[str]:
    """The overrides of a verification run: ``steps`` steps, every one recorded (no warm-up, census, profiling)."""
    return [
        *overrides,
        f"train.steps={steps}",
        "train.warmup_steps=0",
        "train.profile_steps=0",
        "train.activation_census=false",
        "train.trace=false",
    ]


def _perturbations(reference: RunPlan, candidate: RunPlan) -> list[int]:
    mbs, other = reference.run_config.batch.mbs, candidate.run_config.batch.mbs
    return [m for m in dict.fromkeys([other, mbs // 2, mbs * 2]) if m >= 1 and m != mbs]


def verify(
    candidate: Sequence[str],
    reference: Sequence[str],
    *,
    steps: int = DEFAULT_STEPS,
    out_dir: Path,
    plan: PlanFn = compose_plan,
    progress: Callable[[str], None] = lambda line: None,
) -> Verdict:
    """Train ``reference``, its re-split twin and ``candidate`` (override lists) for ``steps`` steps each under
    ``out_dir/runs`` and compare; ``verify.json`` in ``out_dir`` records the verdict. Invalid configs raise
    :class:`VerifyError` before anything runs. ``plan`` composes and validates overrides as ``moe-vlm-sweep run``
    does; the sweeper passes its own (Hydra is already initialized inside a sweep)."""
    if steps < 2:
        raise VerifyError(f"--steps={steps} must be >= 2: one step shows no training")
    try:
        ref_plan = plan(run_overrides(reference, steps))
        seeds = [f"train.seed={ref_plan[0].run_config.train.seed}", f"data.seed={ref_plan[0].run_config.data.seed}"]
        cand_plan = plan(run_overrides([*candidate, *seeds], steps))
    except INVALID_ERRORS as exc:
        raise VerifyError(str(exc)) from None
    twin, perturbation = ref_plan, "a re-run (no other micro-batch split is valid)"
    for mbs in _perturbations(ref_plan[0], cand_plan[0]):
        try:
            twin = plan(run_overrides([*reference, f"batch.mbs={mbs}"], steps))
        except INVALID_ERRORS:
            continue
        perturbation = f"batch.mbs={mbs} instead of {ref_plan[0].run_config.batch.mbs}"
        break
    runs: dict[str, RunResult] = {}
    for name, (run_plan, resolved) in (("reference", ref_plan), ("perturbed", twin), ("candidate", cand_plan)):
        run_dir = new_run_dir(out_dir, prefix=name)
        prepare(run_dir, run_plan, resolved)
        progress(f"verify: training the {name} ({steps} steps) in {run_dir}")
        runs[name] = launch(run_plan, run_dir)
    failed = {name: r for name, r in runs.items() if not r.ok}
    if failed:
        verdict = Verdict(
            status="error",
            steps=steps,
            reason="; ".join(
                f"the {name} run failed ({r.status}): {(r.reason or '').strip()[-300:]}" for name, r in failed.items()
            ),
        )
    else:
        verdict = compare({name: r.metrics.loss for name, r in runs.items() if r.metrics is not None})
    verdict.perturbation = perturbation
    verdict.recipes = {"reference": ref_plan[0].recipe, "candidate": cand_plan[0].recipe}
    verdict.run_dirs = {name: r.run_dir for name, r in runs.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / VERIFY_FILE, record(verdict, reference, candidate))
    log.info("verify %s: %s", verdict.status, json.dumps(verdict.run_dirs))
    return verdict
