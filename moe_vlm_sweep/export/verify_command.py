"""``moe-vlm-sweep verify [STUDY | OVERRIDES] [--against OVERRIDES] [--steps N]``: does the candidate train the
same model as its reference? (``export/verify.py`` says how the loss and gradient-norm curves are compared.)

    moe-vlm-sweep verify STUDY                      the study's best (its exported winner, else its top trial of
                                                    the baseline's recipe) against the study's first trial
    moe-vlm-sweep verify STUDY --against OVERRIDES  the same candidate against the named config
    moe-vlm-sweep verify OVERRIDES --against OVERRIDES

Exit 0: the candidate's loss and gradient norm stay within their tolerances at every step; 1: they do not, or a run
failed; 2: invalid input.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import optuna
import yaml

from moe_vlm_sweep.console import help_summary, say
from moe_vlm_sweep.export.best import ExportError, ranked
from moe_vlm_sweep.export.recipes import RecipeError
from moe_vlm_sweep.export.study_args import add_study_arguments, load_study
from moe_vlm_sweep.export.verify import DEFAULT_STEPS, VerifyError, verify


def study_pair(study: optuna.Study, sweep_dir: Path) -> tuple[int, list[str], list[str]]:
    """(winner's number, its overrides, the first trial's overrides): the exported winner if ``best`` wrote one,
    else the top trial of the baseline's recipe."""
    top_file = sweep_dir / "best" / "top.yaml"
    top = yaml.safe_load(top_file.read_text()) if top_file.exists() else None
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    if top:
        number = top[0]["trial"]
    else:
        best = ranked(study)
        if not best:
            raise ExportError(f"study {study.study_name} has no successful trial to verify")
        number = best[0].number
    first = min((t for t in trials.values() if t.user_attrs.get("overrides")), key=lambda t: t.number, default=None)
    if first is None:
        raise ExportError(f"study {study.study_name} has no trial with recorded overrides")
    return number, list(trials[number].user_attrs["overrides"]), list(first.user_attrs["overrides"])


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-vlm-sweep verify", description=help_summary(__doc__))
    parser.add_argument("target", nargs="*", help="a study name, or the candidate's overrides")
    parser.add_argument("--against", nargs="+", metavar="OVERRIDE", help="the reference's overrides")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"steps per run (default {DEFAULT_STEPS})")
    add_study_arguments(parser, positional=False)
    args = parser.parse_args(list(argv))
    outputs = Path(args.outputs)
    study_name: str | None = None
    try:
        if (len(args.target) == 1 and "=" not in args.target[0]) or (not args.target and args.storage):
            name, _, study = load_study(outputs, args.target[0] if args.target else None, args.storage)
            number, candidate, first = study_pair(study, outputs / "sweeps" / name)
            reference = args.against or first
            study_name, out_dir = name, outputs / "sweeps" / name / "verify"
            say(
                f"verify: trial #{number} of {name} against "
                + ("the given overrides" if args.against else "the study's first trial")
            )
        else:
            if not args.against:
                raise VerifyError("verify OVERRIDES needs --against OVERRIDES (the reference config)")
            candidate, reference, out_dir = list(args.target), list(args.against), outputs / "verify"
        verdict = verify(candidate, reference, steps=args.steps, out_dir=out_dir, progress=say)
    except (VerifyError, ExportError, RecipeError) as exc:
        say(f"error: {exc}", err=True)
        return 2
    say(verdict.summary())
    say(f"  record: {out_dir / 'verify.json'}" + (f" (study {study_name})" if study_name else ""))
    return 0 if verdict.passed else 1
