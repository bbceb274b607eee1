"""``moe-vlm-sweep ui`` serves the sweep's MLflow store: parent and children visible over the REST API."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from sweep_testing import SPACE_HEADER, cli, private_conf

from moe_vlm_sweep.tracking.mlflow_sink import flatten

SPACE = (
    SPACE_HEADER
    + """n_trials: 2
fixed: {model: tiny, parallel: fsdp}
params:
  parallel.pp: [2, 4]
"""
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(port: int, path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/2.0/mlflow/{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_flatten_nests_with_dots():
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": None}) == {"a.b": 1, "a.c.d": [1], "e": None}


def test_ui_refuses_a_missing_store(tmp_path):
    proc = cli(["ui", "--outputs", str(tmp_path / "nothing")], cwd=tmp_path, conf=private_conf(tmp_path), check=False)
    assert proc.returncode == 2 and "run a sweep first" in proc.stderr


@pytest.mark.slow
def test_ui_serves_parent_and_children(tmp_path):
    conf = private_conf(tmp_path, {"ui_space": SPACE})
    cli(["run", "-m", "sweep=ui_space"], cwd=tmp_path, conf=conf)  # all invalid: tracked, nothing trained
    port = _free_port()
    env = {**os.environ, "MOE_VLM_SWEEP_CONF": str(conf)}
    ui = subprocess.Popen(
        [sys.executable, "-m", "moe_vlm_sweep.cli", "ui", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                experiment = _api(port, "experiments/get-by-name?experiment_name=moe-vlm-sweep")["experiment"]
                break
            except OSError:
                assert ui.poll() is None and time.monotonic() < deadline, ui.stdout.read().decode()[-3000:]
                time.sleep(1)
        runs = _api(port, "runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
        tags = [{t["key"]: t["value"] for t in run["data"].get("tags", [])} for run in runs]
        parents = [t for t in tags if t.get("moe_vlm_sweep.role") == "parent"]
        children = [t for t in tags if t.get("moe_vlm_sweep.role") == "trial"]
        assert len(parents) == 1 and len(children) == 2
        assert all(c["mlflow.parentRunId"] == runs[tags.index(parents[0])]["info"]["run_id"] for c in children)
    finally:
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=30) == 0
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ui.pid, signal.SIGKILL)  # the server's own group is ended by `ui`; this one is ours
    with pytest.raises(OSError):
        _api(port, "experiments/search", {"max_results": 1})
