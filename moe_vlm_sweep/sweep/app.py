"""``moe-vlm-sweep run -m ...``: the Hydra multirun app over ``conf/`` (config ``config``).

``-m sweep=<space>`` selects this project's sweeper (the space file overrides ``hydra/sweeper``); a plain grid
(``-m batch.mbs=1,2``) runs on Hydra's basic sweeper. Either way each job is :func:`task`, the same path as
``moe-vlm-sweep run``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from moe_vlm_sweep.config.compose import CONF_DIR, with_searchpath
from moe_vlm_sweep.config.store import register
from moe_vlm_sweep.console import say
from moe_vlm_sweep.launch import slurm
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.result import RunResult
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.launch.status import RunStatus
from moe_vlm_sweep.launch.summary import summarize
from moe_vlm_sweep.sweep import early_stop
from moe_vlm_sweep.sweep.trial import INVALID_ERRORS, plan_trial


def task(cfg: DictConfig) -> RunResult:
    """One job: validate, then train in an isolated process. An invalid grid point is reported, not raised, so
    a grid sweep goes on past it (the sweeper never hands over an invalid config in the first place)."""
    hydra_cfg = HydraConfig.get()
    try:
        plan, resolved_yaml = plan_trial(cfg, list(hydra_cfg.overrides.task))
    except INVALID_ERRORS as exc:
        say(f"error: {exc}", err=True)
        return RunResult(status=RunStatus.INVALID, reason=str(exc))
    run_dir = new_run_dir(plan.run_config.outputs_dir, prefix=f"job{hydra_cfg.job.num}")
    prepare(run_dir, plan, resolved_yaml)
    # Forked from this process's warm trial host (imports paid once) unless sweep.warm_host=false or Slurm runs the
    # job (sweep/spec.py says why); stopped early if the sweeper says so.
    warm = bool(OmegaConf.select(cfg, "sweep.warm_host", default=True)) and not slurm.is_submitit(hydra_cfg.launcher)
    result = launch(plan, run_dir, warm=warm, watch=early_stop.active())
    say(summarize(result))
    return result


def multirun(argv: Sequence[str]) -> int:
    register()
    app = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(task)
    saved, sys.argv = sys.argv, ["moe-vlm-sweep", *with_searchpath(argv)]
    try:
        app()
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        sys.argv = saved
    return 0
