"""``moe-vlm-sweep ui``: the MLflow UI on the default store (SQLite under the outputs folder), on 127.0.0.1.

It runs ``python -m mlflow server`` in the foreground; nothing listens beyond this machine unless the user
asks with ``--host``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from moe_vlm_sweep.console import help_summary, say
from moe_vlm_sweep.tracking.mlflow_sink import default_artifact_root, default_uri


def ui_command(outputs_dir: str | Path, *, host: str, port: int, tracking_uri: str | None = None) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        tracking_uri or default_uri(outputs_dir),
        "--default-artifact-root",
        default_artifact_root(outputs_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="moe-vlm-sweep ui", description=help_summary(__doc__))
    parser.add_argument("--outputs", default="outputs", help="outputs folder holding mlflow.db (default: outputs)")
    parser.add_argument("--tracking-uri", default=None, help="another MLflow store instead of the default")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(list(argv))
    db = Path(args.outputs) / "mlflow.db"
    if args.tracking_uri is None and not db.exists():
        say(f"error: {db} does not exist yet; run a sweep first (moe-vlm-sweep run -m sweep=cpu_demo)", err=True)
        return 2
    say(f"MLflow UI: http://{args.host}:{args.port}  (Ctrl-C stops it)")
    # The server forks its own web workers: run it in its own process group and end that whole group on the way out,
    # whether we stop by Ctrl-C or by SIGTERM, so no server outlives the command.
    proc = subprocess.Popen(
        ui_command(args.outputs, host=args.host, port=args.port, tracking_uri=args.tracking_uri),
        env=os.environ.copy(),
        start_new_session=True,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return proc.wait()
    except (KeyboardInterrupt, SystemExit):
        return 0
    finally:
        _end_group(proc)


def _end_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
