"""Opening the Optuna study of a sweep: its stable name, its storage, its sampler.

The name is ``<space>-<hash>`` of the space, the fixed overrides and the objective, so the same command always
reaches the same study (that is what makes re-running it a resume) and changing the space starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna
import sqlalchemy
import sqlalchemy.engine
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
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(
            f"cannot create the sweep's folder {sweep_dir} ({exc.strerror}): make outputs_dir "
            "writable, or set outputs_dir (or sweep.storage) to a writable place"
        ) from None
    return f"sqlite:///{sweep_dir.resolve() / 'optuna.db'}"


class StorageError(RuntimeError):
    """The study's storage cannot be used as it is (unreachable, read-only, damaged, missing the study); the
    message says which and what to do. The CLI exits 2 on it, with no traceback."""


CONNECT_TIMEOUT_S = 5
"""How long a database server may take to accept a connection before the sweep says it is unreachable."""
_DAMAGED = ("malformed", "not a database", "file is encrypted")


def driver_url(url: str) -> str:
    """``postgresql://`` with the driver named: psycopg2, the one the project installs (``psycopg2-binary``) and the
    one Optuna's and MLflow's own PostgreSQL examples use. SQLAlchemy 2.1 maps a bare ``postgresql://`` to
    psycopg 3, which would be a second driver for the same job; an explicit ``postgresql+<driver>://`` is kept."""
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            return "postgresql+psycopg2://" + url[len(bare) :]
    return url


def _shown(url: str) -> str:
    """The URL without its password, for messages."""
    return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True) if "://" in url else url


def _sqlite_problem(url: str) -> str | None:
    path = Path(url[len("sqlite:///") :]) if url.startswith("sqlite:///") else None
    if path is None or str(path) in ("", ":memory:"):
        return None
    if not path.parent.is_dir():
        return f"its folder {path.parent} does not exist"
    if path.exists():
        writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    else:
        writable = os.access(path.parent, os.W_OK | os.X_OK)
    if writable:  # os.access says yes to root on a read-only mount: try it
        try:
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as exc:
            return f"its folder {path.parent} is not writable ({exc.strerror})"
        return None
    return f"{path if path.exists() else path.parent} is read-only"


def storage_problem(exc: BaseException, url: str) -> StorageError:
    """A storage exception (SQLAlchemy's, or Optuna's wrapper of it) in plain words."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    first = text[0] if text else type(exc).__name__
    where = _shown(url)
    if url.startswith("sqlite:"):
        if any(word in first for word in _DAMAGED):
            return StorageError(
                f"the Optuna database {where} is damaged ({first}): restore it from a copy, or "
                "move it away to start a new study (MLflow keeps the old one's runs)"
            )
        if "readonly" in first or "read-only" in first:
            return StorageError(
                f"the Optuna database {where} is read-only ({first}): make it writable, or set "
                "sweep.storage to a writable place"
            )
        return StorageError(f"cannot use the Optuna database {where}: {first}")
    return StorageError(
        f"cannot reach the study's database server at {where}: {first}; start the server, or "
        "check sweep.storage's host, port and credentials (the same command resumes)"
    )


def open_storage(url: str) -> RDBStorage:
    """Optuna's RDB storage at ``url``, with a storage problem found in a few seconds and said plainly."""
    if not url.startswith(("sqlite:", "postgresql", "postgres:", "mysql")):
        raise SweepSpecError(f"sweep.storage={url!r} must be a sqlite:///, postgresql:// or mysql:// URL")
    url = driver_url(url)
    if problem := _sqlite_problem(url):
        raise StorageError(
            f"sweep.storage={url}: {problem}; make it writable, or set sweep.storage to a writable place"
        )
    if url.startswith("sqlite:"):
        kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    else:
        kwargs = {
            "pool_pre_ping": True,
            "connect_args": {"connect_timeout": CONNECT_TIMEOUT_S} if "psycopg2" in url else {},
        }
        try:
            engine = sqlalchemy.create_engine(url, **kwargs)
            with engine.connect():
                pass
            engine.dispose()
        except ImportError as exc:
            raise StorageError(
                f"sweep.storage={_shown(url)} needs a driver that is not installed ({exc}); "
                "install it, or name an installed one (postgresql+psycopg2://...)"
            ) from None
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise storage_problem(exc, url) from None
    for attempt in range(10):
        try:
            return RDBStorage(url, engine_kwargs=kwargs)
        except (
            sqlalchemy.exc.OperationalError,
            sqlalchemy.exc.IntegrityError,
            sqlalchemy.exc.ProgrammingError,
            sqlalchemy.exc.DatabaseError,
        ) as exc:
            # Workers started together on a fresh database race to create its tables; the loser retries and
            # then finds them (Optuna creates them in one transaction, so a retry sees all or none). A damaged
            # or read-only file is not a race: it is said at once.
            error = storage_problem(exc, url)
            if attempt == 9 or any(word in str(error) for word in ("damaged", "read-only")):
                raise error from None
            time.sleep(1.0 + attempt)
        except optuna.exceptions.StorageInternalError as exc:
            raise storage_problem(exc.__cause__ or exc, url) from None
    raise AssertionError("unreachable")


def sampler(spec: SweepConf, seed: int) -> optuna.samplers.BaseSampler:
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # multivariate + group: TPE models the params that co-occur together, which conditional params need.
    # Ten random trials first: after four, TPE's "good" set was a single trial and it proposed that trial's config
    # again and again (duplicates, never launched, taught it nothing; seen in the first H200 study).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=min(STARTUP_TRIALS, spec.n_trials), multivariate=True, group=True
        )


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


def neighbor_of_best(study: optuna.Study, space: Space, rng: random.Random) -> tuple[int, dict[str, Any]] | None:
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
    tried = [
        t.system_attrs.get("fixed_params", {}) if t.state == TrialState.WAITING else t.params
        for t in study.get_trials(deepcopy=False)
        if t.user_attrs.get("claim") not in NOT_COUNTED
    ]
    fresh = [
        n
        for n in space.neighbors(best.params)
        if not any(all(key in p and p[key] == value for key, value in n.items()) for p in tried)
    ]
    return (best.number, rng.choice(fresh)) if fresh else None


def open_study(
    *, name: str, url: str | None, spec: SweepConf, lost: Callable[[], str | None] | None = None
) -> optuna.Study:
    """The study ``name`` in ``url``, created if new. ``lost()`` is asked before creating one: a reason not to
    (MLflow already holds this study's trials, so its database was emptied or replaced) stops the sweep instead
    of starting the study over beside its old runs."""
    storage = open_storage(url) if url else optuna.storages.InMemoryStorage()
    directions = spec.objective.directions
    try:
        try:
            existing = optuna.load_study(study_name=name, storage=storage)
        except KeyError:
            existing = None
        if existing is not None:
            found = [d.name.lower() for d in existing.directions]
            if found != directions:
                raise SweepSpecError(
                    f"study {name!r} in {url} optimizes {found}, but sweep.objective asks "
                    f"{directions}; set a new sweep.study_name"
                )
            seed = spec.seed + len(existing.trials)
            return optuna.load_study(study_name=name, storage=storage, sampler=sampler(spec, seed))
        if lost is not None and (why := lost()):
            raise StorageError(
                f"study {name} is not in {_shown(url or 'memory')}, but {why}: the Optuna database "
                "was emptied or replaced. Restore it from a copy, or start a new study with "
                "sweep.study_name=NEW"
            )
        return optuna.create_study(
            study_name=name,
            storage=storage,
            directions=[optuna.study.StudyDirection[d.upper()] for d in directions],
            sampler=sampler(spec, spec.seed),
            load_if_exists=True,
        )
    except (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError) as exc:
        raise storage_problem(
            exc.__cause__ or exc if isinstance(exc, optuna.exceptions.StorageInternalError) else exc, url or ""
        ) from None
