"""Unit tests of the worker's pure pieces: synthetic batches and result files (FLOPs: tests/test_flops.py)."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from contract_samples import sample_metrics as _metrics

from moe_vlm_sweep.config.schema import DataConf, ModelConf
from moe_vlm_sweep.data.synthetic import IMAGE_TOKEN_INDEX, PAD_TOKEN_ID, SyntheticImages
from moe_vlm_sweep.metrics.schema import (
    Failure,
    read_failure,
    read_metrics,
    write_failure,
    write_json_atomic,
    write_metrics,
)

MODEL = ModelConf(text_tokens=65)


def _source(**data) -> SyntheticImages:
    return SyntheticImages(MODEL, DataConf(**data), micro_batch_size=4)


@pytest.mark.parametrize("images_per_sample", [1, 2])
def test_batch_counts_padding(images_per_sample):
    model = ModelConf(text_tokens=65, images_per_sample=images_per_sample)
    mb = SyntheticImages(model, DataConf(), micro_batch_size=4).microbatch(0, 0)
    assert mb.padded_tokens == 4 * model.seq_length
    assert mb.images.shape == (4 * images_per_sample, 3, 56, 56)
    expected_real = sum(int(n) + images_per_sample * (model.image_tokens - 1) for n in mb.text_lengths)
    assert mb.real_tokens == expected_real < mb.padded_tokens
    for row, length in zip(mb.input_ids, mb.text_lengths):
        assert (row[:images_per_sample] == IMAGE_TOKEN_INDEX).all()
        assert (row[length:] == PAD_TOKEN_ID).all() and (row[images_per_sample:length] != PAD_TOKEN_ID).all()


def test_labels_shifted_and_loss_mask_covers_real_caption_only():
    mb = _source().microbatch(0, 0)
    assert torch.equal(mb.labels[:, :-1], mb.input_ids[:, 1:])
    masked_labels = mb.labels[mb.loss_mask.bool()]
    assert (masked_labels != PAD_TOKEN_ID).all() and (masked_labels != IMAGE_TOKEN_INDEX).all()
    assert mb.loss_tokens == int(sum(n - 2 for n in mb.text_lengths))  # caption minus its first id, minus the end


def test_full_text_fraction_has_no_padding():
    mb = _source(min_text_fraction=1.0).microbatch(0, 0)
    assert mb.real_tokens == mb.padded_tokens


def test_batches_are_deterministic_and_fixed_batch_repeats():
    a, b = _source(seed=3), _source(seed=3)
    assert torch.equal(a.microbatch(5, 1).input_ids, b.microbatch(5, 1).input_ids)
    assert not torch.equal(a.microbatch(0, 0).input_ids, a.microbatch(1, 0).input_ids)
    fixed = _source(fixed_batch=True)
    assert torch.equal(fixed.microbatch(0, 0).images, fixed.microbatch(7, 0).images)
    other_rank = SyntheticImages(MODEL, DataConf(), micro_batch_size=4, dp_rank=1)
    assert not torch.equal(other_rank.microbatch(0, 0).input_ids, a.microbatch(0, 0).input_ids)


def test_metrics_round_trip(tmp_path):
    metrics = _metrics()
    write_metrics(tmp_path, metrics)
    assert read_metrics(tmp_path) == metrics
    data = json.loads((tmp_path / "metrics.json").read_text())
    assert data["schema_version"] == 1 and data["status"] == "ok"


def test_failure_round_trip_and_class_check(tmp_path):
    failure = Failure(
        failure_class="oom", exception_type="OutOfMemoryError", message="m", rank=1, step=3, traceback="tb"
    )
    write_failure(tmp_path, failure)
    assert read_failure(tmp_path) == failure
    with pytest.raises(ValueError, match="failure_class='segfault'"):
        Failure(failure_class="segfault", exception_type="X", message="", rank=0, step=None, traceback="")


def _fail_at_once(run_dir: Path, rank: int, start, results) -> None:
    failure = Failure(
        failure_class="crash", exception_type="E", message=f"rank {rank}", rank=rank, step=1, traceback=""
    )
    start.wait()
    results.put((rank, write_failure(run_dir, failure).name))


def test_the_first_of_ranks_failing_at_once_is_the_cause_and_the_others_are_kept(tmp_path):
    """Ranks in separate processes fail at the same moment, many times over: in each run exactly one rank's
    failure is failure.json (the one whose write said so), and every other rank's is kept beside it."""
    ranks, rounds = 6, 15
    ctx = multiprocessing.get_context("fork")
    for attempt in range(rounds):
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        start, results = ctx.Barrier(ranks), ctx.Queue()
        procs = [ctx.Process(target=_fail_at_once, args=(run_dir, r, start, results)) for r in range(ranks)]
        for proc in procs:
            proc.start()
        written = dict(results.get(timeout=30) for _ in range(ranks))
        for proc in procs:
            proc.join(timeout=30)
        winners = [rank for rank, name in written.items() if name == "failure.json"]
        assert len(winners) == 1, f"round {attempt}: {written}"
        assert read_failure(run_dir).rank == winners[0]
        for rank in set(range(ranks)) - set(winners):
            assert json.loads((run_dir / f"failure.rank{rank}.json").read_text())["message"] == f"rank {rank}"
        assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == []  # no temporary left


def test_atomic_write_never_leaves_partial_files(tmp_path):
    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # fails half-way through serialising
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.json"]


def test_skip_jax_makes_jax_unimportable_for_te_without_breaking_spec_probes():
    """TE's ``from . import jax`` must end in the ImportError it ignores; ``find_spec`` probes must not raise."""
    code = (
        "import importlib.util\n"
        "from moe_vlm_sweep.train.worker import skip_jax\n"
        "skip_jax()\n"
        "assert importlib.util.find_spec('jax') is None\n"
        "try:\n    import jax\nexcept ImportError:\n    print('jax skipped')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "jax skipped"


def test_a_failed_census_step_leaves_the_run_its_results():
    """The census runs after every measurement: if a library rejects saved-tensor hooks, the run says why."""
    from types import SimpleNamespace

    from moe_vlm_sweep.train.loop import Trainer

    def step(microbatches):
        x = torch.ones(4, requires_grad=True)
        (x * x).sum()  # saves x under the census
        raise RuntimeError("saved tensor hooks are not supported here")

    measured, sources, failure = Trainer._census_step(SimpleNamespace(chunks=[], _step=step), [])
    assert measured is None and sources is None
    assert failure == "RuntimeError: saved tensor hooks are not supported here"
    assert not torch._C._autograd._top_saved_tensors_default_hooks(False), "the hooks must be gone"


def test_gpu_defaults_keep_the_kernel_fusions_and_leave_compiled_or_unmeasured_ones_off():
    """TE's fused kernels cost nothing to start; megatron's torch.compile'd fusions compile in every trial."""
    from moe_vlm_sweep.config.schema import FusionsConf

    resolved = FusionsConf().resolved(on_gpu=True)
    assert resolved["rope"] and resolved["masked_softmax"] and resolved["moe_permute"]
    assert not any(resolved[f] for f in ("bias_dropout", "cross_entropy", "bias_activation", "moe_router"))


@pytest.mark.parametrize("fused", [False, True])
def test_fused_router_reaches_the_decoder_only(fused):
    """``fusions.moe_router`` is megatron's ``moe_router_fusion`` in the MoE decoder; the dense ViT and projector
    have no router, so their configs keep it off."""
    from moe_vlm_sweep.config.compose import compose_run_config
    from moe_vlm_sweep.model.build import decoder_config, projector_config, vision_config
    from moe_vlm_sweep.plan.plan import make_plan

    plan = make_plan(
        compose_run_config(
            ["model=tiny", "hardware=h200", "parallel=3d", "fusions=off", f"fusions.moe_router={str(fused).lower()}"]
        )
    )
    decoder = decoder_config(plan)
    assert decoder.moe_router_fusion is fused
    assert not vision_config(plan, decoder).moe_router_fusion and not projector_config(plan, decoder).moe_router_fusion


@pytest.mark.parametrize("fused", [False, True])
def test_fused_swiglu_reaches_every_megatron_config_and_the_memory_estimate(fused):
    """Set, ``fusions.bias_activation`` reaches megatron's decoder config and the estimate, which keeps three
    expert widths per routed token instead of six; the ViT and projector keep exact GELU (megatron's fused one is
    the tanh approximation). The other fusions are off: megatron checks those against TE, which CI lacks."""
    from moe_vlm_sweep.config.compose import compose_run_config
    from moe_vlm_sweep.model.build import decoder_config, projector_config, vision_config
    from moe_vlm_sweep.plan.memory import activation_parts
    from moe_vlm_sweep.plan.plan import make_plan

    overrides = ["model=tiny", "hardware=h200", "parallel=3d", "fusions=off"]
    plan = make_plan(compose_run_config([*overrides, f"fusions.bias_activation={str(fused).lower()}"]))
    decoder = decoder_config(plan)
    assert decoder.bias_activation_fusion is fused
    assert vision_config(plan, decoder).bias_activation_fusion is False
    assert projector_config(plan, decoder).bias_activation_fusion is False
    cfg, d = plan.run_config, plan.run_config.model.decoder
    unfused = activation_parts(compose_run_config(overrides), plan.seq_length)
    saved = 3 * d.moe_router_topk * d.moe_ffn_hidden_size * 2 * cfg.batch.mbs * plan.seq_length * d.num_layers
    assert unfused["decoder.layers"] - activation_parts(cfg, plan.seq_length)["decoder.layers"] == saved * fused


def _slowest_of_two(rank: int, store_file: str, out_file: str) -> None:
    import torch.distributed as dist

    from moe_vlm_sweep.config.schema import RunConfig
    from moe_vlm_sweep.plan.plan import make_plan
    from moe_vlm_sweep.train.worker import _slowest_rank

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    times = _slowest_rank([[1.0, 5.0], [3.0, 2.0]][rank], make_plan(RunConfig()))
    if rank == 0:
        Path(out_file).write_text(json.dumps(times))
    dist.destroy_process_group()


def test_a_step_takes_as_long_as_its_slowest_rank(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "times.json"
    mp.spawn(_slowest_of_two, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    assert json.loads(out.read_text()) == [3.0, 5.0]


@pytest.mark.parametrize("n", [1, 2, 3, 10, 37])
def test_step_time_deciles_match_numpys_percentiles(n):
    """p10/p90 of metrics.json interpolate between the measured steps as NumPy's default does, one step included."""
    import numpy as np

    from moe_vlm_sweep.train.worker import _deciles

    times = torch.rand(n, dtype=torch.float64).tolist()
    expected = np.percentile(times, range(10, 100, 10))
    assert np.allclose(_deciles(times), expected, rtol=0, atol=1e-12), (_deciles(times), expected)
