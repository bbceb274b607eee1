"""The DataLoader workers that build steps ahead (``data.loader_workers``): the same micro-batches in the same
order as the source gives directly, the same training, no worker left behind, and a clear error where a
stateful reader cannot be shared."""

from __future__ import annotations

import psutil
import pytest
import torch
from conftest import read_json, why_failed

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.data import Prefetched, make_source, prefetched
from moe_vlm_sweep.data import prefetch as prefetch_module


def _source(*overrides: str):
    cfg = compose_run_config(["model=tiny", *overrides])
    return cfg, make_source(cfg.model, cfg.data, micro_batch_size=2)


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("images", "input_ids", "labels", "loss_mask", "position_ids", "text_lengths"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.cu_seqlens is None) == (y.cu_seqlens is None)
        if x.cu_seqlens is not None:
            assert torch.equal(x.cu_seqlens, y.cu_seqlens)


@pytest.mark.parametrize("packing", ["false", "true"])
@pytest.mark.parametrize("workers", [1, 2])
def test_workers_hand_over_the_sources_own_steps_in_order(packing, workers):
    _, direct = _source(f"data.packing={packing}")
    _, source = _source(f"data.packing={packing}")
    ahead = Prefetched(source, num_microbatches=3, workers=workers)
    try:
        for step in range(5):
            _same(ahead.step(step, 3), direct.step(step, 3))
        with pytest.raises(ValueError, match="asked for step 7 of 3 micro-batches; the workers build step 5"):
            ahead.step(7, 3)
    finally:
        ahead.close()


@pytest.mark.parametrize("data", ["synthetic_images", "mock_text"])
@pytest.mark.parametrize("packing", ["false", "true"])
def test_a_joined_step_splits_back_into_its_micro_batches(data, packing):
    _, source = _source(f"data={data}", f"data.packing={packing}")
    step = source.step(3, 4)
    back = prefetch_module.split(prefetch_module.joined(step))
    _same(back, step)
    assert [mb.image_tokens for mb in back] == [mb.image_tokens for mb in step]


def test_a_step_of_many_micro_batches_holds_a_few_descriptors():
    """torch shares each tensor a worker hands over through a file descriptor: one per field and step, not
    per micro-batch, or a step of a few hundred micro-batches would run the process out of them."""
    _, source = _source("data.packing=true")
    ahead = Prefetched(source, num_microbatches=200, workers=1)
    try:
        before = psutil.Process().num_fds()
        held = [ahead.step(step, 200) for step in range(3)]
        assert len(held) == 3 and psutil.Process().num_fds() - before < 60
    finally:
        ahead.close()


class _FailsAtStep:
    realism = "synthetic_images"

    def __init__(self, source, failing: int):
        self.source, self.failing = source, failing

    def step(self, step: int, num_microbatches: int):
        if step == self.failing:
            raise OSError(f"corrupt shard at step {step}")
        return self.source.step(step, num_microbatches)


def test_a_worker_error_reaches_the_trainer_and_stops_every_worker():
    cfg, source = _source("data.loader_workers=2")
    workers: list[psutil.Process] = []
    with (
        pytest.raises(OSError, match="corrupt shard at step 1"),
        prefetched(
            _FailsAtStep(source, 1), cfg.data, cfg.model, device="cuda", micro_batch_size=2, num_microbatches=2
        ) as ahead,
    ):
        assert isinstance(ahead, Prefetched)
        ahead.step(0, 2)
        workers = psutil.Process().children()
        assert len(workers) == 2  # the DataLoader's two workers
        ahead.step(1, 2)
    # at once: not after the 5 s in which a worker notices its parent is gone
    _, alive = psutil.wait_procs(workers, timeout=2)
    assert not alive


def test_the_default_takes_no_worker_where_the_host_has_no_core_to_spare(monkeypatch, caplog):
    cfg, source = _source()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    with prefetched(source, cfg.data, cfg.model, device="cuda", micro_batch_size=2, num_microbatches=2) as same:
        assert same is source
    assert "1 core(s) in this process's CPU set" in caplog.text
    cfg, source = _source("data.loader_workers=1")  # a number the user set is used as set
    with prefetched(source, cfg.data, cfg.model, device="cuda", micro_batch_size=2, num_microbatches=2) as ahead:
        assert isinstance(ahead, Prefetched)


def test_the_default_takes_no_worker_without_shared_memory_for_the_steps_in_flight(monkeypatch, tmp_path, caplog):
    cfg, source = _source()
    monkeypatch.setattr("moe_vlm_sweep.data.prefetch.SHARED_MEMORY", tmp_path)
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 1024})())
    with prefetched(source, cfg.data, cfg.model, device="cuda", micro_batch_size=2, num_microbatches=2) as same:
        assert same is source
    assert f"0 MiB free in {tmp_path}, and the steps in flight need" in caplog.text


def test_the_workers_stop_when_the_block_ends_however_it_ends():
    cfg, source = _source("data.loader_workers=2")
    workers: list[psutil.Process] = []
    with (
        pytest.raises(RuntimeError, match="a failed step"),
        prefetched(source, cfg.data, cfg.model, device="cuda", micro_batch_size=2, num_microbatches=2) as ahead,
    ):
        assert isinstance(ahead, Prefetched)
        ahead.step(0, 2)
        workers = psutil.Process().children()
        assert len(workers) == 2  # the DataLoader's two workers
        raise RuntimeError("a failed step")
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_no_workers_on_the_cpu_by_default_one_on_a_gpu():
    cfg, source = _source()
    assert cfg.data.loader_workers is None
    assert cfg.data.workers_on("cpu") == 0 and cfg.data.workers_on("cuda") == 1
    with prefetched(source, cfg.data, cfg.model, device="cpu", micro_batch_size=2, num_microbatches=2) as same:
        assert same is source


def test_a_run_with_workers_trains_exactly_as_without(run_cli):
    losses = {}
    for workers in (0, 1):
        code, run_dir = run_cli(
            "model=tiny",
            "train.warmup_steps=1",
            "train.steps=3",
            "train.profile_steps=0",
            f"data.loader_workers={workers}",
        )
        assert code == 0, why_failed(run_dir)
        metrics = read_json(run_dir / "metrics.json")
        losses[workers] = metrics["loss"]["values"]
        assert metrics["recipe"] == read_json(run_dir / "plan.json")["recipe"]["fingerprint"]
    assert losses[1] == losses[0]


@pytest.mark.parametrize(
    ("override", "rule"),
    [
        ("data.loader_workers=-1", "data.loader_workers=-1 must be >= 0"),
        ("data=webdataset data.loader_workers=2", "with data.name=webdataset must be 0 or 1"),
    ],
)
def test_a_bad_worker_count_is_rejected_with_its_rule(override, rule, capsys):
    assert main(["check", "model=tiny", *override.split()]) == 2
    err = capsys.readouterr().err
    assert rule in err and "Traceback" not in err
