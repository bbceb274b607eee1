"""Does a faster config train the same model? Compare its loss curve with its reference's, step by step.

A performance knob (layout, micro-batch size, recompute, graphs, fusions) may change the order of floating-point
reductions and nothing else; a recipe change (dropped tokens, a frozen encoder, a lost mask) changes the loss
from the first step. So the candidate and the reference train ``steps`` steps from the same seeds on the same
batches (each synthetic sample is drawn by its index in the global batch, so any layout sees the same samples
per step: ``data/synthetic.py``), and their per-step losses (``metrics.json``: ``loss.values``) are compared.

How the tolerance is measured, not guessed: the reference is trained a second time with its micro-batches split
differently (the candidate's ``batch.mbs`` if it differs, else half or twice the reference's), a change that
keeps the model, the data and the optimizer and moves only what a performance knob may move: the order of
reductions and the per-micro-batch statistics of the MoE load-balancing loss. Its per-step spread
``|ref'(s) - ref(s)|`` gives the envelope ``E(s) = max over t <= s`` (noise grows as training goes on, it does
not shrink back), and the candidate passes when, at every step,

    |cand(s) - ref(s)| <= HEADROOM * E(s) + LOSS_RESOLUTION * |ref(s)|

``HEADROOM`` (4) leaves room for a candidate that changes several performance knobs at once, each adding noise
of that kind; ``LOSS_RESOLUTION`` (16 float32 ulps of the loss) is the floor when the two reference runs agree
bit for bit (no other split is valid). Measured on the tiny CPU model (gbs 4, mbs 2 against mbs 1, 10 steps):
the spread is 2e-7 at step 0 (the same forward; only the aux loss's gradient differs) and 1.5e-4 by step 9; a
TP=2+SP run deviates from its FSDP reference by at most 3e-7, and drop-and-pad dispatch (capacity factor 1.0)
by 4.5e-4 at step 0 already, 35 times the tolerance there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe_vlm_sweep.config import recipe as recipes
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare, write_json_atomic
from moe_vlm_sweep.plan.compose import compose_plan
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.sweep.trial import INVALID_ERRORS

log = logging.getLogger(__name__)

DEFAULT_STEPS = 30
HEADROOM = 4.0
LOSS_RESOLUTION = 16 * 2.0**-23
"""16 ulps of a float32 loss, relative."""
VERIFY_FILE = "verify.json"

PlanFn = Callable[[list[str]], tuple[RunPlan, str]]


class VerifyError(ValueError):
    """The two configs cannot be compared as asked (invalid config, no reference); exits 2."""


@dataclass(kw_only=True)
class Verdict:
    status: str
    """``pass``, ``fail`` (a step's loss is outside the tolerance) or ``error`` (a run failed: ``reason``)."""
    steps: int
    reason: str = ""
    max_deviation: float | None = None
    """The largest ``|cand(s) - ref(s)|``."""
    max_deviation_step: int | None = None
    worst_step: int | None = None
    """The step whose deviation is the largest share of its tolerance."""
    worst_ratio: float | None = None
    """Deviation / tolerance at ``worst_step``: above 1 fails."""
    perturbation: str = ""
    """How the reference was re-run to measure the tolerance."""
    reference: list[float] = field(default_factory=list)
    perturbed: list[float] = field(default_factory=list)
    candidate: list[float] = field(default_factory=list)
    tolerance: list[float] = field(default_factory=list)
    recipes: dict[str, Any] = field(default_factory=dict)
    """``reference``/``candidate`` -> plan.json's recipe (fingerprint, differs)."""
    run_dirs: dict[str, str | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def summary(self) -> str:
        if self.status == "error":
            return f"verify: ERROR: {self.reason}"
        assert self.worst_step is not None  # every verdict but an error has compared the curves
        ref, cand = self.recipes.get("reference", {}), self.recipes.get("candidate", {})
        lines = [
            f"verify: {self.status.upper()}: largest loss deviation {self.max_deviation:.3g} at step "
            f"{self.max_deviation_step} of {self.steps}; nearest its tolerance at step {self.worst_step}, "
            f"{self.worst_ratio:.2g} x the tolerance {self.tolerance[self.worst_step]:.3g} there",
            f"  tolerance: {HEADROOM:g} x the reference's spread against itself ({self.perturbation}), "
            f"at least {LOSS_RESOLUTION:.2g} x the loss",
        ]
        if ref.get("fingerprint") != cand.get("fingerprint"):
            diff = recipes.describe(recipes.between(cand.get("differs", {}), ref.get("differs", {})))
            lines.append(
                f"  recipes differ: candidate {cand.get('fingerprint')} vs reference {ref.get('fingerprint')}: {diff}"
            )
        return "\n".join(lines)


def compare(reference: Sequence[float], perturbed: Sequence[float], candidate: Sequence[float]) -> Verdict:
    """The verdict on three loss curves of equal length (see the module's docstring for the tolerance)."""
    if not len(reference) == len(perturbed) == len(candidate) > 0:
        raise ValueError(f"loss curves of {len(reference)}, {len(perturbed)} and {len(candidate)} steps")
    envelope, tolerance, ratios = 0.0, [], []
    for ref, pert, cand in zip(reference, perturbed, candidate):
        envelope = max(envelope, abs(pert - ref))
        tolerance.append(HEADROOM * envelope + LOSS_RESOLUTION * abs(ref))
        ratios.append(abs(cand - ref) / tolerance[-1])
    deviations = [abs(c - r) for r, c in zip(reference, candidate)]
    top = max(range(len(deviations)), key=deviations.__getitem__)
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    return Verdict(
        status="pass" if ratios[worst] <= 1.0 else "fail",
        steps=len(reference),
        max_deviation=deviations[top],
        max_deviation_step=top,
        worst_step=worst,
        worst_ratio=ratios[worst],
        reference=list(reference),
        perturbed=list(perturbed),
        candidate=list(candidate),
        tolerance=tolerance,
    )


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
        curves = {name: r.metrics.loss.values for name, r in runs.items() if r.metrics is not None}
        verdict = compare(curves["reference"], curves["perturbed"], curves["candidate"])
    verdict.perturbation = perturbation
    verdict.recipes = {"reference": ref_plan[0].recipe, "candidate": cand_plan[0].recipe}
    verdict.run_dirs = {name: r.run_dir for name, r in runs.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(
        out_dir / VERIFY_FILE,
        {
            **asdict(verdict),
            "headroom": HEADROOM,
            "loss_resolution": LOSS_RESOLUTION,
            "overrides": {"reference": list(reference), "candidate": list(candidate)},
        },
    )
    log.info("verify %s: %s", verdict.status, json.dumps(verdict.run_dirs))
    return verdict
