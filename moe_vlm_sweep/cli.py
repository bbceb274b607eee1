"""The ``moe-vlm-sweep`` console script.

    moe-vlm-sweep check [OVERRIDES]   validate and print the resolved plan (exit 0 valid, 2 invalid)
    moe-vlm-sweep run [OVERRIDES]     validate, then train in an isolated process; prints the result
    moe-vlm-sweep run -m sweep=SPACE [OVERRIDES]   Optuna sweep over conf/sweep/SPACE.yaml (MLflow-tracked)
    moe-vlm-sweep run -m KNOB=a,b ... Hydra grid sweep (basic sweeper)
    moe-vlm-sweep best [STUDY]        export the best trials of a sweep and print how to re-run them
    moe-vlm-sweep verify [STUDY | OVERRIDES] [--against OVERRIDES] [--steps N]
                                      train a candidate and its reference on the same batches, compare losses
    moe-vlm-sweep report [STUDY]      an HTML report of a sweep (plots, top configs, failures) under its folder
    moe-vlm-sweep ui [--port N]       the MLflow UI of the sweeps (outputs/mlflow.db) on 127.0.0.1

check and run take --config-dir DIR (or hydra.searchpath=[file:///DIR]): a folder of your own config group
files (DIR/model/NAME.yaml, DIR/hardware/NAME.yaml, DIR/sweep/NAME.yaml), searched after the packaged ones.
Invalid input exits 2 before any process starts; a run that fails exits 1 with its failure class.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from moe_vlm_sweep.console import configure_logging, say

USAGE = "usage: moe-vlm-sweep COMMAND [ARGS]\n\n" + __doc__.split("\n\n", 1)[1].strip()
EXIT_INVALID = 2
HELP = {
    "check": """usage: moe-vlm-sweep check [OVERRIDES...]

Compose the config from conf/ with Hydra OVERRIDES (model=small batch.mbs=2 ...), validate it against every
rule and print the resolved plan (layout, batch, memory estimate). Exit 0: valid; 2: invalid, with the knob,
the value and the rule. Nothing runs. --config-dir DIR (or hydra.searchpath=[file:///DIR]) adds a folder of your
own config group files, searched after the packaged ones; run takes it too.""",
    "run": """usage: moe-vlm-sweep run [OVERRIDES...]
       moe-vlm-sweep run -m sweep=SPACE [OVERRIDES...]
       moe-vlm-sweep run -m KNOB=a,b [OVERRIDES...]

Without -m: validate like check, then train in an isolated worker process under outputs/runs/ and print the
result (exit 0 ok, 1 failed with its failure class, 2 invalid).
With -m sweep=SPACE: an Optuna sweep over moe_vlm_sweep/conf/sweep/SPACE.yaml, tracked in MLflow; sweep.<knob>
overrides its settings (sweep.n_trials=20). Re-running the same command resumes the study. Ctrl-C or SIGTERM
stops it cleanly (exit 130 / 143) and says how to resume; a bad space or storage exits 2 before any trial.
With -m KNOB=a,b: Hydra's grid sweep, each point a run. Hydra's own flags: run -m --hydra-help.""",
}


def _fail(message: str) -> int:
    say(f"error: {message}", err=True)
    return EXIT_INVALID


def _plan(overrides: Sequence[str]):
    """Compose and validate; return (plan, resolved yaml) or an exit code after printing why."""
    from moe_vlm_sweep.plan.compose import INVALID_ERRORS, compose_plan

    try:
        return compose_plan(overrides)
    except INVALID_ERRORS as exc:
        return _fail(str(exc))


def check(overrides: Sequence[str]) -> int:
    from moe_vlm_sweep.plan.plan import describe
    from moe_vlm_sweep.train.machine_rules import preflight_notes

    planned = _plan(overrides)
    if isinstance(planned, int):
        return planned
    say(describe(planned[0], preflight_notes(planned[0])))
    say("valid")
    return 0


def run(overrides: Sequence[str]) -> int:
    if "-m" in overrides or "--multirun" in overrides:
        from moe_vlm_sweep.sweep.app import multirun

        return multirun(overrides)
    from moe_vlm_sweep.launch.local import launch
    from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
    from moe_vlm_sweep.launch.summary import summarize

    planned = _plan(overrides)
    if isinstance(planned, int):
        return planned
    plan, resolved_yaml = planned
    run_dir = new_run_dir(plan.run_config.outputs_dir)
    prepare(run_dir, plan, resolved_yaml)
    say(f"run dir: {run_dir}")
    result = launch(plan, run_dir)
    say(summarize(result))
    return 0 if result.ok else 1


def report(args: Sequence[str]) -> int:
    from moe_vlm_sweep.export.report import main as report_main

    return report_main(args)


def best(args: Sequence[str]) -> int:
    from moe_vlm_sweep.export.command import main as best_main

    return best_main(args)


def verify(args: Sequence[str]) -> int:
    from moe_vlm_sweep.export.verify_command import main as verify_main

    return verify_main(args)


def ui(args: Sequence[str]) -> int:
    from moe_vlm_sweep.tracking.ui import main as ui_main

    return ui_main(args)


COMMANDS = {"check": check, "run": run, "best": best, "verify": verify, "report": report, "ui": ui}


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        say(USAGE)
        return 0 if args else EXIT_INVALID
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        return _fail(f"unknown command {command!r}; expected one of {', '.join(COMMANDS)}")
    if command in HELP and rest[:1] in (["-h"], ["--help"]):
        say(HELP[command])
        return 0
    if command in ("check", "run"):
        from hydra.errors import HydraException

        from moe_vlm_sweep.config.compose import CompositionError, config_dir_overrides

        try:
            rest = config_dir_overrides(rest)
        except (CompositionError, HydraException) as exc:
            return _fail(str(exc))
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
