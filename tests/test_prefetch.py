"""The DataLoader workers that build steps ahead (``data.loader_workers``): the same micro-batches in the same
order as the source gives directly, the same training, no worker left behind, and a clear error where a
stateful reader cannot be shared."""

from __future__ import annotations

import psutil
import pytest
import torch
from conftest import read_json

from moe_vlm_sweep.cli import main
from moe_vlm_sweep.config.compose import compose_run_config
from moe_vlm_sweep.data import Prefetched, make_source, prefetched


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
    ahead = Prefetched(source, num_microbatches=3, workers=workers, pin_memory=False)
    try:
        for step in range(5):
            _same(ahead.step(step, 3), direct.step(step, 3))
        with pytest.raises(ValueError, match="asked for step 7 of 3 micro-batches; the workers build step 5"):
            ahead.step(7, 3)
    finally:
        ahead.close()


def test_the_workers_stop_when_the_block_ends_however_it_ends():
    cfg, source = _source("data.loader_workers=2")
    workers: list[psutil.Process] = []
    with (
        pytest.raises(RuntimeError, match="a failed step"),
        prefetched(source, cfg.data, device="cuda", num_microbatches=2) as ahead,
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
    with prefetched(source, cfg.data, device="cpu", num_microbatches=2) as same:
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
        assert code == 0, (run_dir / "worker.log").read_text()[-3000:]
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
