"""Real tiny training through the CLI: metrics.json complete, the model learns, multi-process layouts report."""

from __future__ import annotations

import dataclasses
import os

import pytest
from conftest import read_json, why_failed

from moe_vlm_sweep.metrics import schema as ms
from moe_vlm_sweep.plan.memory import ACTIVATION_PARTS


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_tiny_run_writes_every_metric(run_cli):
    code, run_dir = run_cli("model=tiny", "train.steps=4", "train.profile_steps=1")
    assert code == 0, why_failed(run_dir)
    metrics = read_json(run_dir / "metrics.json")
    assert set(metrics) == _fields(ms.Metrics) and set(metrics["step_time_s"]) == _fields(ms.StepTimes)
    # Every field is written, defaults too: what tells is which ones the run left empty. On the CPU only the
    # GPU memory estimate is None, the census did not fail, and nothing ran in FP8.
    typed = ms.read_metrics(run_dir)
    empty = {f.name for f in dataclasses.fields(typed) if getattr(typed, f.name) in (None, [], {}, "")}
    assert empty == {"predicted_peak_memory_gib", "census_failure", "fp8"}
    assert len(metrics["step_time_s"]["steps"]) == 4
    assert metrics["data_realism"] == "synthetic_images"
    assert metrics["recipe"] == read_json(run_dir / "plan.json")["recipe"]["fingerprint"]  # what it trained
    assert metrics["mfu"] > 0 and metrics["peak_source"] == "measured_matmul"
    assert metrics["peak_memory_gib"] > 0
    wall = metrics["wall_s"]
    startup = {f"startup.{phase}" for phase in ("imports", "init", "build", "wrap")}
    assert set(wall) == startup | {"warmup", "measured", "profile", "census"}
    assert all(wall[k] > 0 for k in startup) and wall["measured"] >= sum(metrics["step_time_s"]["steps"])
    # train.warmup_steps=2: one plain warm-up step, then the census step
    assert metrics["loss"]["phases"] == ["warmup", "census", *["measured"] * 4, "profile"]
    norms = metrics["loss"]["grad_norms"]
    assert len(norms) == len(metrics["loss"]["values"]) and all(n > 0 for n in norms) and len(set(norms)) > 1
    warmup = metrics["warmup_step_time_s"]
    assert len(warmup) == 1 and all(v > 0 for v in warmup)
    waits = metrics["warmup_data_wait_s"]
    assert len(waits) == 1 and waits[0] > 0 and wall["warmup"] >= sum(warmup) + sum(waits)
    assert metrics["graphed_layers"] == 0
    assert metrics["cuda_alloc_conf"].endswith("expandable_segments:False")  # the launcher's, from the config
    assert metrics["gc_in_measured_steps"] == {"count": 0, "seconds": 0.0}  # train.manual_gc, the default
    assert metrics["effective_tokens_per_s"] < metrics["tokens_per_s"]
    split = metrics["component_split"]
    assert {f"{c}.{d}" for c in ms.COMPONENTS for d in ("forward", "backward")} <= set(split["seconds"])
    assert abs(sum(split["shares"].values()) - 1) < 1e-6
    assert {"config.yaml", "plan.json", "command.sh", "worker.log", "result.json"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert read_json(run_dir / "result.json")["status"] == "ok"


_MBS = 2


def _census(run_cli, *overrides: str) -> tuple[dict, dict, str]:
    code, run_dir = run_cli("model=tiny", f"batch.mbs={_MBS}", "train.steps=1", "train.profile_steps=0", *overrides)
    assert code == 0, why_failed(run_dir)
    census = read_json(run_dir / "metrics.json")["saved_activations"]
    layers = sum(v for k, v in census["measured_gib"].items() if k.startswith("decoder.layers."))
    return (
        {**census["measured_gib"], "decoder.layers": layers},
        census["predicted_gib"],
        (run_dir / "saved_tensors.txt").read_text(),
    )


def test_the_census_needs_a_plain_warmup_step_before_it(run_cli):
    """With a single warm-up step (the one that pays the one-time costs, which the census's hooks must not
    share) the census is a step of its own after the measured ones, still before the profile step."""
    code, run_dir = run_cli("model=tiny", "train.warmup_steps=1", "train.steps=2", "train.profile_steps=1")
    assert code == 0, why_failed(run_dir)
    metrics = read_json(run_dir / "metrics.json")
    assert metrics["loss"]["phases"] == ["warmup", "measured", "measured", "census", "profile"]
    assert metrics["saved_activations"]["measured_gib"]["total"] > 0
    assert len(metrics["warmup_step_time_s"]) == 1 and len(metrics["step_time_s"]["steps"]) == 2


def test_a_census_that_cannot_count_is_a_visible_census_failure(run_cli, tmp_path, monkeypatch):
    """A worker where saved-tensor hooks are disabled (as torch.func transforms disable them) cannot count: the
    run keeps its measurements, and metrics.json says the census failed and why, not only saved_tensors.txt."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\ntorch._C._autograd._saved_tensors_hooks_disable('no saved-tensor hooks on this machine')\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    code, run_dir = run_cli("model=tiny", "train.steps=1", "train.profile_steps=0")
    assert code == 0, why_failed(run_dir)
    metrics = read_json(run_dir / "metrics.json")
    assert metrics["saved_activations"] is None
    assert metrics["census_failure"] == "RuntimeError: no saved-tensor hooks on this machine"
    assert len(metrics["step_time_s"]["steps"]) == 1  # the measurements are kept
    assert not (run_dir / "saved_tensors.txt").exists()
    assert "the census step failed" in (run_dir / "worker.log").read_text()


def test_the_census_counts_what_autograd_saves_per_part(run_cli):
    """The census step measures the activations plan/memory.py estimates: the estimate stays below it (the CPU's
    local attention even saves its softmax), frozen vision saves nothing, full recompute keeps only layer inputs."""
    measured, predicted, sources = _census(run_cli)
    parts = [k for k in measured if k not in ("total", "decoder.layers")]
    assert abs(sum(measured[k] for k in parts) - measured["total"]) < 1e-9
    for part in ACTIVATION_PARTS:
        assert predicted[part] <= measured[part], (part, predicted[part], measured[part])
    assert measured["decoder.layers.attention"] > 0 and measured["decoder.layers.mlp"] > 0
    assert "cross_entropy.py" in sources and "fused_softmax.py" in sources and "decoder.layers.mlp" in sources
    frozen, frozen_predicted, _ = _census(run_cli, "vision=frozen_encoder")
    assert frozen["vision_encoder"] == 0 == frozen_predicted["vision_encoder"]
    assert frozen["decoder.layers"] == pytest.approx(measured["decoder.layers"], rel=0.15)  # routing differs
    full, _, _ = _census(run_cli, "recompute=full")
    assert full["decoder.layers"] < 0.25 * measured["decoder.layers"]
    # Four micro-batches a step: without pipelining one is in flight when the first backward begins.
    four, four_predicted, _ = _census(run_cli, f"batch.gbs={4 * _MBS}")
    assert four["decoder.layers"] == pytest.approx(measured["decoder.layers"], rel=0.15)
    assert four_predicted["decoder.layers"] == predicted["decoder.layers"]
    # Selective recompute of the norms frees their outputs once the next op has saved them: they count 0.
    norms, _, _ = _census(run_cli, "recompute=selective", "recompute.modules=[layernorm]")
    assert norms["decoder.layers.other"] < 0.8 * measured["decoder.layers.other"]


def test_without_manual_gc_the_collector_pauses_inside_measured_steps(run_cli):
    """What train.manual_gc keeps out of the timings: a training step allocates enough to trigger collections."""
    code, run_dir = run_cli("model=tiny", "train.steps=3", "train.profile_steps=0", "train.manual_gc=false")
    assert code == 0, why_failed(run_dir)
    pauses = read_json(run_dir / "metrics.json")["gc_in_measured_steps"]
    assert pauses["count"] > 0 and pauses["seconds"] > 0


def test_trace_covers_the_profile_steps(run_cli):
    code, run_dir = run_cli("model=tiny", "train.steps=2", "train.profile_steps=1", "train.trace=true")
    assert code == 0, why_failed(run_dir)
    kernels = (run_dir / "kernels.txt").read_text()
    assert "aten::" in kernels and "Self CPU" in kernels and "aten::" in (run_dir / "host_ops.txt").read_text()
    assert '"traceEvents"' in (run_dir / "trace.json").read_text()
    copies = (run_dir / "copies.txt").read_text().splitlines()
    assert copies[0].startswith("copy and cast ops by call site (cpu self time")
    # each site names an op and the project's or a library's frames that issued it
    sites = [i for i, line in enumerate(copies) if " calls  aten::" in line]
    assert sites and any(".py(" in line for line in copies[sites[0] + 1 :])


def test_the_first_step_trace_covers_the_first_step_alone(run_cli):
    """train.trace_first_step: the first warm-up step's ops, by host time, and its trace: one optimizer step."""
    code, run_dir = run_cli("model=tiny", "train.steps=2", "train.profile_steps=0", "train.trace_first_step=true")
    assert code == 0, why_failed(run_dir)
    ops = (run_dir / "first_step_host_ops.txt").read_text()
    assert "aten::" in ops and "Self CPU" in ops
    assert not (run_dir / "first_step_copies.txt").exists()  # call sites need stacks, which the first step skips
    events = read_json(run_dir / "first_step_trace.json")["traceEvents"]
    assert len([e for e in events if e.get("name", "").startswith("Optimizer.step#")]) == 1, "one step traced"
    assert not (run_dir / "trace.json").exists()  # train.trace's, of the profile steps, is another knob


def test_loss_falls_on_a_fixed_batch(run_cli):
    code, run_dir = run_cli(
        "model=tiny",
        "data.fixed_batch=true",
        "train.warmup_steps=0",
        "train.steps=30",
        "train.profile_steps=0",
        "train.lr=3e-3",
    )
    assert code == 0, why_failed(run_dir)
    recorded = read_json(run_dir / "metrics.json")["loss"]
    loss = [v for v, phase in zip(recorded["values"], recorded["phases"]) if phase == "measured"]
    assert len(loss) == 30 and recorded["phases"][30:] == ["census"]  # no warm-up step for the census to take
    assert loss[-1] < 0.5 * loss[0], loss


LAYOUTS = {
    "ep2": ["parallel=3d", "parallel.ep=2"],
    "tp2_sp": ["parallel=3d", "parallel.tp=2", "parallel.sp=true"],
    "pp2": ["parallel=3d", "parallel.pp=2"],
    "fsdp_dp2": ["parallel=fsdp", "parallel.fsdp_sharding=optim_grads_params"],
    # packed rows of a different length on each rank, their tokens exchanged between the two ranks' experts
    "ep2_packed": ["parallel=3d", "parallel.ep=2", "data.packing=true"],
}


def test_packed_training_matches_padded_on_real_tokens_only(run_cli):
    """Real tiny training through megatron's schedules and optimizer, one seed and batch, padded then packed."""
    runs = {}
    for packing in ("false", "true"):
        code, run_dir = run_cli(
            "model=tiny",
            "data.fixed_batch=true",
            "batch.mbs=2",
            "batch.gbs=4",
            "train.steps=3",
            "train.profile_steps=0",
            f"data.packing={packing}",
        )
        assert code == 0, why_failed(run_dir)
        runs[packing] = read_json(run_dir / "metrics.json")
    padded, packed = runs["false"], runs["true"]
    assert padded["real_tokens_per_step"] < padded["padded_tokens_per_step"]
    assert packed["real_tokens_per_step"] == packed["padded_tokens_per_step"] == padded["real_tokens_per_step"]
    assert packed["flops_per_step"]["total"]["model"] == pytest.approx(padded["flops_per_step"]["total"]["model"])
    assert packed["loss"]["values"][0] == pytest.approx(padded["loss"]["values"][0], rel=1e-5)
    # later steps: the routers' load-balancing loss counted the padding in the padded run, so they drift a little
    assert packed["loss"]["values"] == pytest.approx(padded["loss"]["values"], rel=1e-2)
    assert packed["loss"]["values"][-1] < packed["loss"]["values"][0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_two_process_layouts_train(name, run_cli):
    code, run_dir = run_cli(
        "model=tiny", "launcher=torchrun", "launcher.nproc_per_node=2", "train.steps=3", *LAYOUTS[name]
    )
    assert code == 0, why_failed(run_dir)
    metrics = read_json(run_dir / "metrics.json")
    layout = metrics["layout"]
    assert layout["world_size"] == 2
    expected = {
        "ep2": ("ep", 2),
        "tp2_sp": ("tp", 2),
        "pp2": ("pp", 2),
        "fsdp_dp2": ("dp", 2),
        "ep2_packed": ("ep", 2),
    }[name]
    assert layout[expected[0]] == expected[1]
    packed = metrics["real_tokens_per_step"] == metrics["padded_tokens_per_step"]
    assert packed == name.endswith("_packed")  # default data has padding, which only packing drops
    assert all(v == v and v > 0 for v in metrics["loss"]["values"])
    assert metrics["tokens_per_s_per_gpu"] > 0
    contention = metrics["contention"]  # every rank sampled; neither rank is "another process" of the other
    assert len(set(contention["rank_pids"])) == 2 and not {p["pid"] for p in contention["processes"]} & set(
        contention["rank_pids"]
    )
    census = metrics["saved_activations"]  # rank 0's: the first pipeline stage, with every micro-batch in flight
    assert census["microbatches_in_flight"] == (2 if name == "pp2" else 1)
    assert census["measured_gib"]["vision_encoder"] > 0 and census["measured_gib"]["decoder.layers.mlp"] > 0
    assert (census["measured_gib"]["decoder.output"] == 0) == (name == "pp2")  # the loss is on the last stage
