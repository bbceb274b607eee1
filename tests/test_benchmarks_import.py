"""Every benchmark script imports (they import each other as top-level modules from benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_imports(name):
    code = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import {name}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_compare_configs_runs_a_tiny_config_and_writes_its_table(tmp_path):
    """The script every GPU result goes through, end to end on the CPU: one real run, its row in the JSON."""
    out = tmp_path / "compare.json"
    proc = subprocess.run(
        [
            sys.executable,
            "compare_configs.py",
            "--outputs",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            "--common",
            "model=tiny hardware=cpu train.steps=2 train.profile_steps=0",
            "--config",
            "mbs1=batch.mbs=1",
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["runs"]
    assert row["status"] == "ok" and row["graphed_layers"] == 0 and row["loss"]["values"][-1] > 0
    assert result["table"].splitlines()[2].startswith("mbs1 | ok | ")
    assert result["complete"] is True


def test_a_result_is_rewritten_whole_and_says_whether_it_is_complete(tmp_path):
    """The write every benchmark makes after each run: read back as written, the old file replaced in one step."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from compare_configs import write_result
    finally:
        sys.path.remove(str(BENCHMARKS))
    out = tmp_path / "r.json"
    write_result(out, {"runs": [{"config": "a"}]}, complete=False)
    assert json.loads(out.read_text()) == {"runs": [{"config": "a"}], "complete": False}
    write_result(out, {"runs": [{"config": "a"}, {"config": "b"}]}, complete=True)
    assert json.loads(out.read_text()) == {"runs": [{"config": "a"}, {"config": "b"}], "complete": True}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


@pytest.mark.slow
def test_trial_cost_writes_each_trial_as_it_finishes(tmp_path):
    """A run cut off by a time limit keeps its trials: the JSON holds the first trial while the second runs, and
    the last write says the run is complete. ``--also`` adds overrides to the preset's (a traced first step)."""
    out = tmp_path / "cost.json"
    command = [sys.executable, "trial_cost.py", "--hardware", "cpu", "--config", "a=batch.mbs=1", "--repeats", "1"]
    command += ["--also", "train.trace_first_step=true"]
    command += ["--workdir", str(tmp_path / "work"), "--out", str(out)]
    proc = subprocess.Popen(command, cwd=BENCHMARKS, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while not out.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        partial = json.loads(out.read_text())
        assert proc.poll() is None, "the first trial's JSON came only at the end"
        assert partial["complete"] is False
        assert [(r["config"], r["mode"], r["status"]) for r in partial["rows"]] == [("a", "before", "ok")]
        assert partial["summary"]["before"]["ok"] == 1 and partial["summary"]["now"]["trials"] == 0
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log[-3000:]
    final = json.loads(out.read_text())
    assert final["complete"] is True and [r["mode"] for r in final["rows"]] == ["before", "now"]
    assert final["common"].endswith(" train.trace_first_step=true")
    assert all((Path(r["run_dir"]) / "first_step_host_ops.txt").is_file() for r in final["rows"])


def _kernel_wall(tmp_path, best: str) -> subprocess.CompletedProcess:
    common = "model=tiny hardware=cpu parallel=3d batch.gbs=4 train.warmup_steps=1 train.steps=3 train.profile_steps=0"
    return subprocess.run(
        [
            sys.executable,
            "kernel_wall.py",
            "--common",
            common,
            "--plain",
            "batch.mbs=2",
            "--best",
            best,
            "--rounds",
            "1",
            "--outputs",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "wall.json"),
        ],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_kernel_wall_runs_the_plain_loop_beside_the_best_config(tmp_path):
    """Both loops train, each reports its MFU from its own measured steps, and the summary compares them."""
    proc = _kernel_wall(tmp_path, "batch.mbs=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "wall.json").read_text())
    (plain,), (best,) = result["runs"]["plain"], result["runs"]["best"]
    assert plain["status"] == best["status"] == "ok"
    assert 0 < plain["mfu"] < 1 and 0 < best["mfu"] < 1 and len(plain["steps"]) == 3
    summary = result["summary"]
    assert summary["best_over_plain"] == pytest.approx(
        best["effective_tokens_per_s_per_gpu"] / plain["effective_tokens_per_s_per_gpu"]
    )
    assert result["recipe"] == best["recipe"] and result["complete"] is True


def test_kernel_wall_refuses_two_loops_of_different_recipes(tmp_path):
    """A larger GBS is another recipe: the comparison would credit the best config with training something else."""
    proc = _kernel_wall(tmp_path, "batch.mbs=4 batch.gbs=8")
    assert proc.returncode == 2
    assert "different recipes" in proc.stderr and not (tmp_path / "wall.json").exists()


def test_kernel_wall_presets_each_compare_two_plans_of_one_recipe(tmp_path):
    """Every preset's plain loop and best config plan on their card and train one recipe, at its MFU target."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import kernel_wall
    finally:
        sys.path.remove(str(BENCHMARKS))
    for model, preset in kernel_wall.PRESETS.items():
        for hardware, best in preset.best.items():
            overrides = kernel_wall.loop_overrides(preset.common(hardware), preset.plain, best)
            plain_plan = kernel_wall.plan_of(overrides["plain"], tmp_path)
            best_plan = kernel_wall.plan_of(overrides["best"], tmp_path)
            assert (plain_plan.recipe or {})["fingerprint"] == (best_plan.recipe or {})["fingerprint"], (
                model,
                hardware,
            )
            assert best_plan.config["model"]["name"] == model and best_plan.config["hardware"]["name"] == hardware
            assert plain_plan.num_microbatches >= best_plan.num_microbatches >= 1
            assert best_plan.predicted_peak_memory_gib is not None


def test_card_summary_keeps_each_card_in_its_own_table(tmp_path):
    """A confirmation and a kernel-wall result of two cards: two tables, each row its re-run median and recipe."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import card_summary
    finally:
        sys.path.remove(str(BENCHMARKS))
    results = tmp_path / "results"
    (results / "study").mkdir(parents=True)
    confirm = BENCHMARKS / "results" / "h200_small_fused" / "confirm.json"
    (results / "study" / "confirm.json").write_text(confirm.read_text())
    best = ["model=small", "hardware=h100", "batch.gbs=192", "batch.mbs=96", "data.packing=true", "train.steps=8"]
    best.append("train.expandable_segments=true")
    wall = {
        "git_commit": "0123456789abcdef",
        "overrides": {"best": best, "plain": [*best[:3], "batch.mbs=32"]},
        "recipe": "r" * 8,
        "summary": {
            "plain": {"ok": 3, "mfu": 0.15},
            "best": {"ok": 3, "mfu": 0.31, "rerun_cv": 0.01},
            "best_over_plain": 2.0,
        },
    }
    (results / "kernel_wall_h100.json").write_text(json.dumps(wall))
    (results / "cut_off").mkdir()
    cut_off = {
        **wall,
        "complete": False,
        "summary": {**wall["summary"], "best": {"runs": 2, "ok": 2, "mfu": 0.3, "rerun_cv": 0.01}},
    }
    (results / "cut_off" / "kernel_wall_h100.json").write_text(json.dumps(cut_off))
    found = card_summary.rows(results)
    assert [(r["card"], r["model"]) for r in found] == [("h100", "small"), ("h100", "small"), ("h200", "small")]
    h100, h100_cut_off, h200 = found
    assert "cut off after 2 rounds" in h100_cut_off["source"] and "cut off" not in h100["source"]
    assert (h100["mfu"], h100["plain_mfu"], h100["config"]) == (
        0.31,
        0.15,
        "batch.mbs=96 data.packing=true train.expandable_segments=true",
    )
    assert h200["mfu"] == json.loads(confirm.read_text())["candidates"][0]["median_values"][0]
    assert h200["recipe"] == "b59f2707" and h200["reruns"] == 2
    text = card_summary.table(found)
    assert text.index("h100:") < text.index("h200:") and text.count("| 2.00x |") == 2
