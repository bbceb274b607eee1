"""Which study an export command means: the ``STUDY``, ``--storage`` and ``--outputs`` arguments that ``best``,
``report`` and ``verify`` share, and the one lookup behind them, so the three find a study and name a missing one
the same way."""

from __future__ import annotations

import argparse
from pathlib import Path

import optuna

from moe_vlm_sweep.export.best import ExportError
from moe_vlm_sweep.sweep.study import open_storage


def add_study_arguments(parser: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """``STUDY`` (unless the command has its own positionals), ``--storage`` and ``--outputs``."""
    if positional:
        parser.add_argument("study", nargs="?", help="study name (default: the only one under OUTPUTS/sweeps)")
    parser.add_argument("--storage", help="Optuna storage URL (default: OUTPUTS/sweeps/STUDY/optuna.db)")
    parser.add_argument("--outputs", default="outputs", help="outputs folder (default: outputs)")


def find_study(outputs: Path, name: str | None, storage: str | None) -> tuple[str, str]:
    """(study name, storage URL): the given ones, or the single study under ``outputs/sweeps``."""
    if storage is None and name is not None:
        db = outputs / "sweeps" / name / "optuna.db"
        if not db.is_file():
            found = ", ".join(p.parent.name for p in sorted((outputs / "sweeps").glob("*/optuna.db"))) or "none"
            raise ExportError(
                f"no study {name!r} under {outputs / 'sweeps'} (studies there: {found}); name one of "
                "them, or give --storage URL for a study kept elsewhere"
            )
        storage = f"sqlite:///{db.resolve()}"
    if storage is not None:
        if name is None:
            names = optuna.get_all_study_names(storage=open_storage(storage))
            if len(names) != 1:
                raise ExportError(f"{storage} holds {len(names)} studies ({', '.join(names)}); name one")
            name = names[0]
        return name, storage
    dbs = sorted((outputs / "sweeps").glob("*/optuna.db"))
    if len(dbs) != 1:
        found = ", ".join(p.parent.name for p in dbs) or "none"
        raise ExportError(
            f"{len(dbs)} studies under {outputs / 'sweeps'} ({found}); say which: moe-vlm-sweep best STUDY"
        )
    return dbs[0].parent.name, f"sqlite:///{dbs[0].resolve()}"


def load_study(outputs: Path, name: str | None, storage: str | None) -> tuple[str, str, optuna.Study]:
    """(name, storage URL, study) of :func:`find_study`'s study; ExportError where the storage lacks it."""
    name, storage = find_study(outputs, name, storage)
    try:
        return name, storage, optuna.load_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        raise ExportError(
            f"no study {name!r} in {storage}; list them with optuna studies --storage {storage}"
        ) from None
