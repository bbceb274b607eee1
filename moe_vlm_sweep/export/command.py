"""``moe-vlm-sweep best [STUDY]``: rank a study, write its top configs, print how to re-run the winner.

``--confirm N`` first re-runs each of the ``--top`` trials N times and exports the one whose median holds
(``moe_vlm_sweep.export.confirm``). With ``--time-budget-s`` (the time left in an allocation) it
starts no re-run that would overrun it and exits with status 3, exporting nothing; the same command reuses the
finished re-runs and goes on.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from moe_vlm_sweep.config.compose import exports_dir
from moe_vlm_sweep.console import help_summary, say
from moe_vlm_sweep.export import recipes
from moe_vlm_sweep.export.best import ExportError, export, realism_of
from moe_vlm_sweep.export.confirm import CONFIRM_FILE, confirm
from moe_vlm_sweep.export.confirm import table as confirm_table
from moe_vlm_sweep.export.study_args import add_study_arguments, load_study
from moe_vlm_sweep.sweep.budget import TimeBudget
from moe_vlm_sweep.sweep.progress import table
from moe_vlm_sweep.sweep.spec import SweepSpecError
from moe_vlm_sweep.sweep.study import StorageError


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-vlm-sweep best", description=help_summary(__doc__))
    add_study_arguments(parser)
    parser.add_argument("--top", type=int, default=3, help="how many trials to export (default: 3)")
    parser.add_argument(
        "--confirm",
        type=int,
        default=0,
        metavar="N",
        help="re-run each of the --top trials N times first and export the one whose median "
        "holds (default: 0, no re-runs)",
    )
    parser.add_argument(
        "--time-budget-s",
        type=float,
        metavar="S",
        help="with --confirm: start no re-run that would end after S seconds; exit 3 if any is "
        "left (the same command resumes; default: no limit)",
    )
    parser.add_argument(
        "--recipe",
        metavar="FINGERPRINT",
        help="rank the trials of this recipe (default: the baseline's, the study's first trial)",
    )
    args = parser.parse_args(list(argv))
    if args.time_budget_s is not None and (not args.confirm or args.time_budget_s <= 0):
        say(
            f"error: --time-budget-s={args.time_budget_s:g} bounds --confirm re-runs: it needs --confirm N "
            "and a positive number of seconds",
            err=True,
        )
        return 2
    outputs = Path(args.outputs)
    try:
        name, _, study = load_study(outputs, args.study, args.storage)
        sweep_dir = outputs / "sweeps" / name
        held = None
        if args.confirm:
            say(
                f"confirm: re-running the top {args.top} trial(s) {args.confirm} time(s) each under "
                f"{sweep_dir / 'confirm'}"
            )
            confirmation = confirm(
                study,
                sweep_dir=sweep_dir,
                top_k=args.top,
                repeats=args.confirm,
                progress=say,
                budget=TimeBudget(args.time_budget_s, knob="--time-budget-s"),
                recipe=args.recipe,
            )
            if not confirmation.complete:
                say(f"confirmation: stopped: {confirmation.stopped}")
                return 3
            held = confirmation.winner
            if confirmation.candidates:
                say(f"\n{confirm_table(confirmation)}\n  details: {sweep_dir / 'best' / CONFIRM_FILE}\n")
            if confirmation.candidates and held is None:
                say("error: no candidate held: each had a failed re-run; nothing exported", err=True)
                return 1
        exported = export(
            study,
            sweep_dir=sweep_dir,
            conf_dir=exports_dir(outputs),
            top_k=args.top,
            confirmed=held.trial if held else None,
            recipe=args.recipe,
        )
        realism = realism_of([e.trial for e in exported])
        mixed = recipes.note(study, recipes.chosen(study, args.recipe), explicit=args.recipe is not None)
    except (ExportError, SweepSpecError, StorageError, recipes.RecipeError) as exc:
        say(f"error: {exc}", err=True)
        return 2
    if not exported:
        say(f"error: study {name} has no successful trial yet", err=True)
        return 1
    metrics = study.user_attrs.get("objective_metrics", [f"value{i}" for i in range(len(study.directions))])
    say(table([e.trial for e in exported], metrics, realism=realism))
    if mixed:
        say(mixed)
    held_median = held.median_values if held else None  # the held candidate succeeded every repeat: it has them
    how = f", confirmed: median {held_median[0]:.4g} over {args.confirm} re-run(s)" if held_median else ""
    say(
        f"\nbest: trial #{exported[0].trial.number} (data realism {realism}{how})\n  {exported[0].command}\n"
        f"  files: {sweep_dir / 'best'}, {exports_dir(outputs) / 'experiment' / exported[0].experiment}.yaml"
    )
    return 0
