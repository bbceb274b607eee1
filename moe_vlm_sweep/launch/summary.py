"""One readable block per finished run: the result a person looks at first."""

from __future__ import annotations

from moe_vlm_sweep.launch.result import RunResult


def _size(gib: float) -> str:
    return f"{gib:.2f} GiB" if gib >= 1 else f"{gib * 1024:.1f} MiB"


def summarize(result: RunResult) -> str:
    m = result.metrics
    if not result.ok or m is None:
        return f"FAILED ({result.status}): {result.reason}\n  see {result.run_dir}/worker.log"
    st, loss = m.step_time_s, m.loss.values
    rows = [
        (
            "step time",
            f"{st.median * 1e3:.1f} ms median (p10 {st.p10 * 1e3:.1f}, p90 {st.p90 * 1e3:.1f}, "
            f"CV {st.cv * 100:.1f}%, {len(st.steps)} steps)",
        ),
        (
            "tokens/s/GPU",
            f"{m.effective_tokens_per_s_per_gpu:.0f} effective, {m.tokens_per_s_per_gpu:.0f} padded",
        ),
        (
            "TFLOP/s/GPU",
            f"{m.model_tflops_per_s_per_gpu:.3f} useful -> MFU {m.mfu * 100:.2f}% "
            f"(HFU {m.hfu * 100:.2f}%, peak {m.peak_tflops:.2f} {m.peak_source})",
        ),
        ("peak memory", f"{m.peak_memory_gib:.2f} GiB ({m.peak_memory_source})"),
        ("loss", f"{loss[0]:.4f} -> {loss[-1]:.4f}"),
        ("data realism", m.data_realism),
    ]
    if m.wall_s:
        rows.append(("wall", ", ".join(f"{k} {v:.1f} s" for k, v in m.wall_s.items())))
    if m.warmup_step_time_s:
        rows.append(("warm-up steps", ", ".join(f"{v:.2f}" for v in m.warmup_step_time_s) + " s"))
    if m.graphed_layers:
        rows.append(("cuda graphs", f"{m.graphed_layers} decoder layers graphed"))
    census = m.saved_activations
    if census is not None:
        rows.append(
            (
                "activations",
                f"{_size(census.measured_gib['total'])} saved for backward, estimate "
                f"{_size(census.predicted_gib['total'])} ({census.microbatches_in_flight:g} "
                "micro-batch(es) in flight; sources in saved_tensors.txt)",
            )
        )
    split = m.component_split
    if split is not None:
        rows.append(("split", ", ".join(f"{k} {v * 100:.0f}%" for k, v in split.shares.items())))
    width = max(len(k) for k, _ in rows)
    body = "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
    return f"ok in {result.wall_s:.1f} s: {result.run_dir}/metrics.json\n{body}"
