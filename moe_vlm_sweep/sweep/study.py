"""Opening the Optuna study of a sweep: its stable name, its storage, its sampler.

The name is ``<space>-<hash>`` of the space, the fixed overrides and the objective, so the same command always
reaches the same study (that is what makes re-running it a resume) and changing the space starts a new one.
"""

from __future__ import annotations

import contextlib
import random
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import optuna
import sqlalchemy.exc
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from moe_vlm_sweep.sweep.ledger import NOT_COUNTED
from moe_vlm_sweep.sweep.space import Space, fingerprint
from moe_vlm_sweep.sweep.spec import SweepConf, SweepSpecError

STARTUP_TRIALS = 10
"""Random trials before TPE models the space."""
SQLITE_TIMEOUT_S = 120
"""How long a SQLite writer waits for another worker's lock before failing (two workers on one file)."""


def study_name(space_name: str, spec: SweepConf, fixed: Sequence[str]) -> str:
    if spec.study_name:
        return spec.study_name
    return f"{space_name}-{fingerprint(spec.params, sorted(fixed), spec.objective.metrics, spec.objective.directions)}"


def storage_url(spec: SweepConf, sweep_dir: Path | None) -> str | None:
    """``sweep.storage``, else SQLite under ``sweep_dir``; None (in memory, no resume) without a sweep dir."""
    if spec.storage:
        return spec.storage
    if sweep_dir is None:
        return None
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{sweep_dir.resolve() / 'optuna.db'}"


def open_storage(url: str) -> RDBStorage:
    if not url.startswith(("sqlite:", "postgresql", "mysql")):
        raise SweepSpecError(f"sweep.storage={url!r} must be a sqlite:///, postgresql:// or mysql:// URL")
    kwargs = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}} if url.startswith("sqlite:") else {
        "pool_pre_ping": True}
    for attempt in range(10):
        try:
            return RDBStorage(url, engine_kwargs=kwargs)
        except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
            # Workers started together on a fresh database race to create its tables; the loser retries and
            # then finds them (Optuna creates them in one transaction, so a retry sees all or none).
            if attempt == 9:
                raise
            time.sleep(1.0 + attempt)


def sampler(spec: SweepConf, seed: int) -> optuna.samplers.BaseSampler:
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # multivariate + group: TPE models the params that co-occur together, which conditional params need.
    # Ten random trials first: after four, TPE's "good" set was a single trial and it proposed that trial's config
    # again and again (duplicates, never launched, taught it nothing; seen in the first H200 study).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(STARTUP_TRIALS, spec.n_trials),
                                          multivariate=True, group=True)


@contextlib.contextmanager
def exploring(study: optuna.Study, explorer: optuna.samplers.BaseSampler, now: bool) -> Iterator[None]:
    """With ``now``, the trial asked and suggested inside samples from ``explorer`` instead of the study's sampler.

    After a proposal repeated a measured config, TPE has learnt nothing (a duplicate is told as failed) and tends
    to propose the same config again: the second H200 study drew 29 repeats in 53 proposals. A random draw next
    spends the GPU on a config not yet seen, or fills in the params an enqueued ``neighbor_of_best`` leaves out.
    """
    if not now:
        yield
        return
    own, study.sampler = study.sampler, explorer
    try:
        yield
    finally:
        study.sampler = own


def neighbor_of_best(study: optuna.Study, space: Space, rng: random.Random) -> Optional[tuple[int, dict[str, Any]]]:
    """After the sampler repeated a measured config: an untried config one knob from the best trial, to enqueue
    (the best trial's number and the config), or None when every neighbor was tried or there is no single best.

    TPE repeats a config when its model has converged on it; the second H200 study drew 29 repeats in 53
    proposals, and the proxy study spent every other proposal so. Walking one knob out from the best is how a
    performance engineer goes on from there, and it keeps the search where the good configs are; a random draw
    (``exploring``) takes over once the neighbors are used up."""
    if len(study.directions) != 1:
        return None
    try:
        best = study.best_trial
    except ValueError:  # nothing completed yet
        return None
    tried = [t.system_attrs.get("fixed_params", {}) if t.state == TrialState.WAITING else t.params
             for t in study.get_trials(deepcopy=False) if t.user_attrs.get("claim") not in NOT_COUNTED]
    fresh = [n for n in space.neighbors(best.params)
             if not any(all(key in p and p[key] == value for key, value in n.items()) for p in tried)]
    return (best.number, rng.choice(fresh)) if fresh else None


def open_study(*, name: str, url: str | None, spec: SweepConf) -> optuna.Study:
    storage = open_storage(url) if url else optuna.storages.InMemoryStorage()
    directions = spec.objective.directions
    try:
        existing = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        existing = None
    if existing is not None:
        found = [d.name.lower() for d in existing.directions]
        if found != directions:
            raise SweepSpecError(f"study {name!r} in {url} optimizes {found}, but sweep.objective asks {directions}; "
                                 "set a new sweep.study_name")
        seed = spec.seed + len(existing.trials)
        return optuna.load_study(study_name=name, storage=storage, sampler=sampler(spec, seed))
    return optuna.create_study(study_name=name, storage=storage, directions=directions,
                               sampler=sampler(spec, spec.seed), load_if_exists=True)
