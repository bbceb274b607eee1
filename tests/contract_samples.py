"""Valid instances of the run contracts (``metrics/schema.py``), for tests that write or read them."""

from __future__ import annotations

from moe_vlm_sweep.metrics.schema import ComponentFlops, ComponentSplit, Loss, Metrics, StepTimes


def sample_metrics() -> Metrics:
    flops = {"total": ComponentFlops(model=2.0, hardware=3.0)}
    return Metrics(
        data_realism="synthetic_images",
        hardware="cpu",
        device="cpu",
        layout={"tp": 1},
        step_time_s=StepTimes(median=0.1, p10=0.09, p90=0.2, mean=0.12, cv=0.1, steps=[0.1, 0.2]),
        tokens_per_s=10.0,
        tokens_per_s_per_gpu=10.0,
        effective_tokens_per_s=8.0,
        effective_tokens_per_s_per_gpu=8.0,
        padded_tokens_per_step=320,
        real_tokens_per_step=250,
        flops_per_step=flops,
        model_tflops_per_s_per_gpu=1e-3,
        hardware_tflops_per_s_per_gpu=2e-3,
        mfu=0.01,
        hfu=0.02,
        peak_tflops=0.1,
        peak_source="measured_matmul",
        peak_memory_gib=0.5,
        peak_memory_source="peak_rss",
        loss=Loss(values=[6.0, 5.0], phases=["warmup", "measured"]),
        component_split=ComponentSplit(
            seconds={"optimizer": 0.1}, shares={"optimizer": 1.0}, profile_steps=1, measured_on="rank 0"
        ),
        accounting_notes=["note"],
    )
