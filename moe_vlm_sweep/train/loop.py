"""Warmup, measured and profiling steps of one run, with real gradient accumulation through megatron's schedules.

Per step: zero the grad buffers and the optimizer, run ``get_forward_backward_func()`` over ``num_microbatches``
(PP=1, PP>1 and interleaved VPP alike), ``optimizer.step()``. The step's micro-batches are made and copied to the
device before its clock starts, as a prefetching data loader would have them ready. Measured steps carry no hooks
and no syncs beyond one at each end of the step; the per-component split comes from separate profiling steps
afterwards. What is measured, and how, is ``train/measure.py``: context managers around the steps, nothing
patched. TE CUDA graphs are captured after ``cuda_graph.warmup_steps`` eager steps, as Megatron-LM does; the
``local`` implementation captures itself inside megatron's schedules.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module, MegatronModule

from moe_vlm_sweep.config.schema import ParallelConf
from moe_vlm_sweep.console import say
from moe_vlm_sweep.data import make_source
from moe_vlm_sweep.data.batch import BatchSource, MicroBatch
from moe_vlm_sweep.model.flops import SUMMED_FIELDS, BatchTokens
from moe_vlm_sweep.plan.plan import RunPlan
from moe_vlm_sweep.train import measure
from moe_vlm_sweep.train.census import SavedTensorCensus
from moe_vlm_sweep.train.cuda_graphs import LLaVADecoderGraphs, local_graphed_layers, numbered
from moe_vlm_sweep.train.steps import MeasuredSteps

Phase = Literal["warmup", "measured", "census", "profile"]


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (failure class ``nan``)."""


logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step_times: list[float] = field(default_factory=list)
    """Measured steps only."""
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float | None] = field(default_factory=list)
    """Per step, the gradients' global L2 norm before clipping, as megatron's optimizer computes it."""
    phases: list[str] = field(default_factory=list)
    batches: list[BatchTokens] = field(default_factory=list)
    """Per step, over the world (summed over data-parallel ranks): the real and padded tokens the step's FLOPs
    and token rates are computed from."""
    split_seconds: dict[str, float] | None = None
    """Mean seconds per profiling step per phase, or None without profiling steps."""
    graphed_layers: int = 0
    """Decoder layers (per rank) replaying TE CUDA graphs in the measured steps."""
    wall_s: dict[str, float] = field(default_factory=dict)
    """Wall-clock seconds per part of the schedule (``warmup``, ``capture``, ``measured``, ``profile``), data,
    reductions and syncs included: what a run costs beyond its measured steps."""
    warmup_step_times: list[float] = field(default_factory=list)
    """Seconds of each warm-up step, timed like a measured one (synced, without fetching data)."""
    data_wait_s: list[float] = field(default_factory=list)
    """Per measured step, the seconds its micro-batches took to fetch (decode included) before its timer started."""
    warmup_data_wait_s: list[float] = field(default_factory=list)
    """The same per warm-up step: the first includes the loader workers' start and their first step's build."""
    gc_in_measured_steps: dict[str, float] = field(default_factory=dict)
    """Python garbage collections that ran inside the measured steps: ``count`` and ``seconds``."""
    saved_activation_bytes: dict[str, int] | None = None
    """The census step's count of bytes saved for backward, per part (None without a census step)."""
    saved_tensor_sources: str | None = None
    """The census step's largest sources of saved bytes, as a table (``saved_tensors.txt``)."""
    census_failure: str | None = None
    """Why the census step failed (its exception), or None: the run keeps its measurements and says so."""
    measuring: MeasuredSteps | None = None
    """How many steps were measured and why measuring stopped (``train/steps.py``)."""


def training_stream(plan: RunPlan) -> contextlib.AbstractContextManager:
    """The stream a run that captures CUDA graphs wraps, trains and captures on: a side stream, never the legacy
    default one. Eager runs stay on the default stream, as Megatron-LM's loop does.

    Autograd nodes keep the stream they were created on; parameters' AccumulateGrad nodes created on the default
    stream (by the DDP wrapper or the eager warmup steps) make TE's backward capture fail with
    cudaErrorStreamCaptureImplicit ("would make the legacy stream depend on a capturing blocking stream", seen
    on the H200). PyTorch's CUDA-graph notes prescribe warming up on a side stream for this reason. Only capture
    needs it, and the Megatron-FSDP baseline ran at half its earlier speed once every run used it
    (benchmarks/results/README.md).
    """
    if plan.device == "cuda" and plan.run_config.cuda_graph.impl != "none":
        return torch.cuda.stream(torch.cuda.Stream())
    return contextlib.nullcontext()


def wrap_for_training(plan: RunPlan, chunks: list[MegatronModule]):
    """Data-parallel wrapping (Megatron DDP or Megatron-FSDP) and the distributed Megatron optimizer."""
    cfg = plan.run_config
    config = chunks[0].config
    bf16, fsdp = plan.precision == "bf16", cfg.parallel.strategy == "fsdp"
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy=cfg.parallel.fsdp_sharding if fsdp else "no_shard",
        gradient_reduce_div_fusion=plan.device == "cuda",  # gloo has no PREMUL_SUM
    )
    device = torch.device("cuda", torch.cuda.current_device()) if plan.device == "cuda" else torch.device("cpu")
    models = []
    for i, chunk in enumerate(chunks):
        chunk.to(device)
        module = Float16Module(config, chunk) if bf16 else chunk
        if fsdp:
            models.append(FullyShardedDataParallel(config, ddp_config, module, device=device))
        else:  # later chunks of an interleaved pipeline share the first chunk's bucketing (as Megatron-LM does)
            models.append(DistributedDataParallel(config, ddp_config, module, disable_bucketing=i > 0))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.train.lr,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=bf16,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            use_distributed_optimizer=True,
        ),
        models,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    _set_sync_funcs(config, models, cfg.parallel)
    return models, optimizer


def rank_source(plan: RunPlan) -> BatchSource:
    """This rank's batches: its data-parallel replica's share of every step (ranks of one replica read the same)."""
    cfg = plan.run_config
    return make_source(
        cfg.model,
        cfg.data,
        micro_batch_size=cfg.batch.mbs,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )


def _set_sync_funcs(config: Any, models: list, parallel: ParallelConf) -> None:
    """What the pipeline schedules call to overlap data-parallel communication, set as Megatron-LM's training
    setup sets them (its defaults: gradients aligned, parameter gathers left to the modules' forward hooks): no
    gradient sync until the last micro-batch, then bucket by bucket as backward fills them."""

    def one_or_list(funcs: list) -> Any:
        return funcs[0] if len(funcs) == 1 else funcs

    if parallel.overlap_grad_reduce:
        config.no_sync_func = one_or_list([model.no_sync for model in models])
        config.grad_sync_func = one_or_list([model.start_grad_sync for model in models])


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Sum of per-token losses over real tokens and their count; megatron divides by the step's total count."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output.float().reshape(-1) * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.detach().float()])}


def packed_inputs(mb: MicroBatch, seq_length: int, transformer_impl: str) -> dict:
    """How attention keeps a packed micro-batch's samples apart: TE's THD boundaries (``packed_seq_params``), or
    a block-causal mask for megatron's local attention, which has no THD. Nothing for a padded micro-batch.

    ``max_seqlen`` is the planned sequence, an upper bound of every sample's, not the batch's own maximum: one
    value for every micro-batch, so the attention backend's kernel plan does not change from one to the next.
    """
    if not mb.packed:
        return {"attention_mask": None}
    if int(mb.decoder_lengths.max()) > seq_length:  # RoPE's table has seq_length rows; nothing else would check
        raise ValueError(
            f"a packed sample has {int(mb.decoder_lengths.max())} decoder tokens, more than the "
            f"plan's seq_length={seq_length}"
        )
    if transformer_impl != "transformer_engine":
        return {"attention_mask": mb.block_causal_mask()}
    return {
        "attention_mask": None,
        "packed_seq_params": PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            max_seqlen_q=seq_length,
            max_seqlen_kv=seq_length,
        ),
    }


def _forward_step(plan: RunPlan, data_iterator, model):
    mb: MicroBatch = next(data_iterator)
    output, loss_mask = model(
        images=mb.images,
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        labels=mb.labels,
        loss_mask=mb.loss_mask,
        **packed_inputs(mb, plan.seq_length, plan.transformer_impl),
    )
    return output, partial(_loss_func, loss_mask)


def step_tokens(microbatches: list[MicroBatch], seq_length: int) -> BatchTokens:
    """What this rank's micro-batches of a step hold: its tokens, real and padded, and its images."""
    return BatchTokens.total(
        [
            BatchTokens.from_lengths(
                mb.decoder_lengths.tolist(), images=mb.images.shape[0], seq_length=seq_length, packed=mb.packed
            )
            for mb in microbatches
        ]
    )


class Trainer:
    def __init__(self, plan: RunPlan, chunks: list[MegatronModule], source: BatchSource):
        self.plan, self.chunks, self.source = plan, chunks, source
        self.cfg = plan.run_config
        self.models, self.optimizer = wrap_for_training(plan, chunks)
        self.config = chunks[0].config
        self.marks = measure.PhaseMarks(plan.device)
        self._finalize, self.config.finalize_model_grads_func = (
            self.config.finalize_model_grads_func,
            self._finalize_grads,
        )
        self.forward_backward = get_forward_backward_func()
        self._grad_norm: float | None = None
        self.image_dtype = torch.bfloat16 if plan.precision == "bf16" else torch.float32
        self.loss_owner = (
            parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        )

    def _fetch(self, step: int) -> list[MicroBatch]:
        """The step's micro-batches, on the device, fetched before the step's timer starts: what a prefetching
        loader would hand over if it kept up; ``data_wait_s`` records how long the fetch took instead."""
        return [mb.to(self.plan.device, self.image_dtype) for mb in self.source.step(step, self.plan.num_microbatches)]

    def _step(self, microbatches: list[MicroBatch]) -> None:
        self._grad_norm = None  # a step that fails before its optimizer step (a failed census) records none
        iterators = [numbered(microbatches, model) for model in self.models]
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._losses = self.forward_backward(
            forward_step_func=partial(_forward_step, self.plan),
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.models,
            num_microbatches=self.plan.num_microbatches,
            seq_length=self.plan.seq_length,
            micro_batch_size=self.cfg.batch.mbs,
            decoder_seq_length=self.plan.seq_length,
            forward_only=False,
        )
        with self.marks.span("optimizer"):
            _, self._grad_norm, _ = self.optimizer.step()

    def _finalize_grads(self, *args: Any, **kwargs: Any) -> None:
        """Megatron's ``finalize_model_grads_func`` callback (the data-parallel reduction and what follows),
        marked as ``grad_sync`` in the profile steps."""
        with self.marks.span("grad_sync"):
            self._finalize(*args, **kwargs)

    def _capture_graphs(self) -> int:
        """TE CUDA graphs of the decoder layers under ``cuda_graph.modules``; megatron's helper resets the grad
        buffers and optimizer grads after capture, so the next step starts clean."""
        helper = LLaVADecoderGraphs(
            self.models,
            self.config,
            seq_length=self.plan.seq_length,
            micro_batch_size=self.cfg.batch.mbs,
            optimizers=[self.optimizer],
        )
        return helper.capture()

    def _reduce(self, step: int, microbatches: list[MicroBatch], result: TrainResult) -> None:
        """World-wide loss over real tokens and token counts (each DP rank counted once), and the step's gradient
        norm (already global: megatron's optimizer reduces it over every rank holding gradients)."""
        loss = torch.zeros(2, dtype=torch.float64)
        if self.loss_owner:
            for reduced in self._losses:
                loss += reduced["lm loss"].detach().to("cpu", torch.float64)
        local = step_tokens(microbatches, self.plan.seq_length)
        # Summed over replicas in float64: exact up to 2**53 (attention pairs grow as gbs * seq_length**2 / 2).
        counts = torch.tensor([getattr(local, name) for name in SUMMED_FIELDS], dtype=torch.float64)
        first_of_replica = (
            parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_pipeline_model_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0
        )
        payload = torch.cat([loss, counts if first_of_replica else torch.zeros_like(counts)])
        if self.plan.device == "cuda":
            payload = payload.cuda()
        dist.all_reduce(payload)
        payload = payload.cpu()
        value = float(payload[0] / payload[1]) if payload[1] > 0 else float("nan")
        if not math.isfinite(value):
            raise NonFiniteLoss(f"loss is {value} at step {step}")
        result.losses.append(value)
        result.grad_norms.append(None if self._grad_norm is None else float(self._grad_norm))
        result.batches.append(
            BatchTokens(
                **{name: float(v) for name, v in zip(SUMMED_FIELDS, payload[2:])},
                seq_length=self.plan.seq_length,
                packed=local.packed,
            )
        )

    def schedule(self) -> list[tuple[Phase, int]]:
        """The phases in order and their steps. The census step is the last warm-up step: an untimed step that
        would run anyway, so the census costs a trial no step of its own. The first warm-up step stays plain, as
        it absorbs the one-time costs (kernel loads, compiles) that must not be paid under the census's hooks; so
        with fewer than two warm-up steps the census is a step of its own after the measured ones. It always
        comes before the profile steps, whose hooks stay on to the end."""
        t = self.cfg.train
        census = int(t.activation_census and self.cfg.cuda_graph.impl == "none")
        if census and t.warmup_steps >= 2:
            return [
                ("warmup", t.warmup_steps - 1),
                ("census", 1),
                ("measured", t.steps),
                ("profile", t.profile_steps),
            ]
        return [("warmup", t.warmup_steps), ("measured", t.steps), ("census", census), ("profile", t.profile_steps)]

    def run(
        self,
        on_step: Callable[[int], None] = lambda step: None,
        trace_dir: Path | None = None,
        on_measured: Callable[[float, BatchTokens], None] = lambda seconds, batch: None,
        first_step_trace_dir: Path | None = None,
    ) -> TrainResult:
        """The steps of ``schedule``; with ``trace_dir``, torch.profiler covers the profile steps, and with
        ``first_step_trace_dir`` the first step. ``on_measured`` gets each measured step's time and tokens as soon
        as it is known."""
        result = TrainResult()
        for model in self.models:
            model.train()
        schedule = self.schedule()
        measuring = result.measuring = MeasuredSteps(self.cfg.train, self.plan.device)
        total, steps = sum(count for _, count in schedule), itertools.count()
        with (  # on any exit: the profiler stops, its hooks go, the collector is back on
            measure.GcPauses() as pauses,
            measure.ManualGc(self.cfg.train.manual_gc) as manual_gc,
            measure.Profiling(self.chunks, self.marks, trace_dir) as profiling,
        ):
            for phase, count in schedule:
                for _ in range(count):
                    if phase == "measured" and measuring.stop is not None:
                        break  # the steps' CV is within train.target_cv (or the ceiling is reached)
                    step = next(steps)
                    manual_gc.before(phase)
                    profiling.before(phase)
                    on_step(step)
                    if self.cfg.cuda_graph.impl == "transformer_engine" and step == self.cfg.cuda_graph.warmup_steps:
                        with measure.wall(result.wall_s, "capture"):
                            result.graphed_layers = self._capture_graphs()
                    with measure.wall(result.wall_s, phase):
                        fetching = time.perf_counter()
                        microbatches = self._fetch(step)
                        waits = {"measured": result.data_wait_s, "warmup": result.warmup_data_wait_s}
                        if phase in waits:
                            waits[phase].append(time.perf_counter() - fetching)
                        timer = measure.StepTimer(self.plan.device, pauses, count_gc=phase == "measured")
                        traced = measure.first_step_trace(first_step_trace_dir if step == 0 else None, self.plan.device)
                        with traced, profiling.step(phase), timer:
                            self._phase_step(phase, microbatches, result)
                        self._record(step, total, phase, microbatches, timer.seconds, result)
                        if self.cfg.cuda_graph.impl == "local" and step == 0:
                            result.graphed_layers = local_graphed_layers(self.models)
                        if phase == "measured":
                            on_measured(timer.seconds, result.batches[-1])
                            measuring.record(timer.seconds)
        result.gc_in_measured_steps = pauses.summary()
        result.split_seconds = profiling.split_seconds(self.cfg.train.profile_steps)
        return result

    def _phase_step(self, phase: Phase, microbatches: list[MicroBatch], result: TrainResult) -> None:
        """A training step; the census phase's step counts the bytes saved for backward as well."""
        if phase == "census":
            (result.saved_activation_bytes, result.saved_tensor_sources, result.census_failure) = self._census_step(
                microbatches
            )
        else:
            self._step(microbatches)

    def _record(
        self, step: int, total: int, phase: Phase, microbatches: list[MicroBatch], seconds: float, result: TrainResult
    ) -> None:
        """The step's time in its phase's list (the census step, timed with its hooks on, in none), and its
        world-wide loss and tokens and a progress line."""
        if phase == "measured":
            result.step_times.append(seconds)
        elif phase == "warmup":
            result.warmup_step_times.append(seconds)
        self._reduce(step, microbatches, result)
        result.phases.append(phase)
        _progress_line(step, total, phase, seconds, result)

    def _census_step(self, microbatches: list[MicroBatch]) -> tuple[dict[str, int] | None, str | None, str | None]:
        """One step under the census: (bytes per part, sources table, None), or (None, None, why it failed).
        If a library on some machine rejects saved-tensor hooks, the run goes on to its measured steps and
        ``metrics.json`` says why the census is missing (``census_failure``). Running out of memory is the
        config's, not the census's: it fails the run as any step would."""
        try:
            with SavedTensorCensus(self.chunks) as counted:
                self._step(microbatches)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.warning("the census step failed, the run keeps its measurements without it: %s", reason)
            return None, None, reason
        return counted.bytes, counted.table(), None


def _progress_line(step: int, steps: int, phase: str, elapsed: float, result: TrainResult) -> None:
    """One line per step in the worker's log (rank 0), so a person (or the sweep's console) sees a trial train:
    the step's time and its real tokens per second over the world, with the loss."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    tokens = result.batches[-1].real_tokens if result.batches else 0.0
    say(
        f"[step {step + 1}/{steps} {phase}] {elapsed * 1e3:.1f} ms, {tokens / max(elapsed, 1e-9):.0f} real tok/s, "
        f"loss {result.losses[-1]:.4f}"
    )
