"""Where a trial's wall time goes: the same configs run the way a sweep ran them before and the way it runs them
now, side by side in one invocation.

``before``: a fresh interpreter per trial, megatron-core's torch.compile'd fusions on (``bias_dropout`` and
``cross_entropy``, GPU only), each step's batches built between steps (``data.loader_workers=0``), a fixed
``train.steps``: how sweeps ran before the cheap-trial work. ``now``: the sweep's current default path: a trial
forked from the warm trial host where ``sweep.warm_host`` is on by default (``--warm-host on|off`` overrides
it), the shared compile caches, the default fusions (``fusions=auto``), the next steps' batches built by a
DataLoader worker while a step trains (``data.loader_workers``' default on a GPU), and an adaptive number of
measured steps (``train.target_cv``, ``train.min_steps``; ``train/steps.py``) with the
config's ``train.steps`` as the ceiling. Each mode has its own outputs directory, so its compile caches
(``launch/compile_cache.py``) start empty in both; they alternate per config so machine drift hits both.

Per trial, by phase (from the worker's ``metrics.json`` and the launcher's wall): imports, init (process groups,
the CPU's peak), build, wrap (DDP/FSDP and the optimizer), the first step's fetch (its wait for its micro-batches:
the loader workers' start and first build), the first warm-up step, the other warm-up (the rest of the warm-up
phase, graph capture included), the timed steps (the sum of the measured steps' times), census
and profile steps, and ``rest`` (the launcher's wall minus all of those: start or fork, teardown, the measured
phase's data fetch and reductions, writing the result). ``timed %`` is the timed steps' share of the trial's
wall, the part of a GPU-hour that measures; ``steps`` how many steps were measured and why measuring stopped. A
warm mode's first trial includes the host's start (its imports), once per sweep.

On GPU hardware the invocation then measures the default's fusions one at a time, in the ``now`` mode after the
configs (so the compile caches hold what a sweep's later trials find): ``fusions=auto`` (the default), then the
default without each fusion that ``auto`` turns on. A fusion's compile cost is the default's first warm-up step
minus the first step without it; what it buys is the median step time without it minus the default's. A fusion
whose cost is not paid back over a trial's warm-up and measured steps is one to leave off by default
(``config/schema.py: FusionsConf``); the summary's ``fusions`` says which. Each is taken out of the default rather
than added to ``fusions=off``: ``off`` is no neutral baseline on packed rows, where megatron's unfused RoPE applies
itself one sample at a time with a host sync per sample (megatron-core 0.19
``models/common/embeddings/rope_utils.py: _apply_rotary_pos_emb_thd``). What ``fusions=auto`` turns on beyond
``off`` (read from megatron-core 0.19 and Transformer Engine 2.x): ``moe_permute`` (TE's
``moe_permute``/``moe_unpermute``/``moe_sort_chunks_by_index``, whose mask-map path runs Triton kernels,
``transformer_engine/pytorch/triton/permutation.py``, JIT-compiled and autotuned per process unless the compile
cache keeps them), ``rope`` (TE's fused rotary embedding, a CUDA kernel built with TE) and ``masked_softmax``
(megatron's ``FusedScaleMaskSoftmax``, which only the local attention spec reads: under TE specs the attention is
TE's own).

    python benchmarks/trial_cost.py --out benchmarks/results/trial_cost_cpu.json            # CPU, model=tiny
    python benchmarks/trial_cost.py --hardware h100 --no-fusion-probes --out trial_cost_h100.json   # GPU configs
    python benchmarks/trial_cost.py --hardware h100 --probes-only --repeats 2 --out probes_h100.json  # fusions
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from compare_configs import git_commit, write_result

from moe_vlm_sweep.launch import warm_host
from moe_vlm_sweep.launch.local import launch
from moe_vlm_sweep.launch.run_dir import new_run_dir, prepare
from moe_vlm_sweep.metrics.schema import Metrics
from moe_vlm_sweep.plan.compose import compose_plan
from moe_vlm_sweep.sweep.spec import SweepConf

TARGET_CV = 0.02
"""The ``now`` mode's ``train.target_cv``: steps whose CV is within 2% move the median by less than the noise
the confirmation accepts (``export/confirm.py``)."""
MIN_STEPS = 4
COMPILED_FUSIONS = "fusions.bias_dropout=true fusions.cross_entropy=true"
"""megatron-core's torch.compile'd fusions (``megatron.core.jit.jit_fuser``), on in every GPU trial before."""


@dataclass(frozen=True)
class Mode:
    name: str
    warm: bool
    extra: str
    """Overrides added to every config of this mode."""


def modes(hardware: str, warm_host_now: bool) -> tuple[Mode, Mode]:
    compiled = "" if hardware == "cpu" else COMPILED_FUSIONS  # the CPU runs no fusions
    return (
        Mode("before", warm=False, extra=f"{compiled} data.loader_workers=0".strip()),
        Mode("now", warm=warm_host_now, extra=f"train.target_cv={TARGET_CV} train.min_steps={MIN_STEPS}"),
    )


PHASES = (
    "imports",
    "init",
    "build",
    "wrap",
    "first_fetch",
    "first_step",
    "other_warmup",
    "timed_steps",
    "census_profile",
    "rest",
)
PRESETS = {
    "cpu": (
        "model=tiny hardware=cpu train.warmup_steps=1 train.steps=6 train.profile_steps=0",
        {  # cpu_demo's space
            "mbs1": "batch.mbs=1",
            "mbs2_frozen": "batch.mbs=2 vision=frozen",
            "mbs4_selective": "batch.mbs=4 recompute=selective dispatcher=allgather",
        },
    ),
    "gpu": (
        "model=small parallel=3d cuda_graph=none recompute=none vision=trainable dispatcher=alltoall batch.gbs=192 "
        "model.text_tokens=1089 data.packing=true fusions.bias_activation=true train.expandable_segments=true "
        "train.warmup_steps=2 train.steps=8 train.timeout_s=300",
        {  # the H100's studies at GBS 192 (h100_small_packed), at MBS that fit with the compiled fused loss
            "mbs32": "batch.mbs=32",
            "mbs48": "batch.mbs=48",
            "mbs48_selective": "batch.mbs=48 recompute=selective recompute.modules=[moe_act,layernorm]",
        },
    ),
}
FUSION_PROBES = {
    "fusions_auto": "",
    "without_moe_permute": "fusions.moe_permute=false",
    "without_rope": "fusions.rope=false",
    "without_masked_softmax": "fusions.masked_softmax=false",
}
"""On GPU hardware, run in the ``now`` mode after the configs, on the first config's shape."""


def phases(metrics: Metrics, wall: float) -> dict[str, float]:
    """The trial's wall split by phase (seconds); ``rest`` is what no phase of the worker accounts for."""
    w, steps = metrics.wall_s, metrics.step_time_s.steps
    first = (metrics.warmup_step_time_s or [0.0])[0]
    fetch = (metrics.warmup_data_wait_s or [0.0])[0]
    split = {
        "imports": w.get("startup.imports", 0.0),
        "init": w.get("startup.init", 0.0),
        "build": w.get("startup.build", 0.0),
        "wrap": w.get("startup.wrap", 0.0),
        "first_fetch": fetch,
        "first_step": first,
        "other_warmup": w.get("warmup", 0.0) + w.get("capture", 0.0) - first - fetch,
        "timed_steps": sum(steps),
        "census_profile": w.get("census", 0.0) + w.get("profile", 0.0),
    }
    split["rest"] = wall - sum(split.values())
    return split


def run_one(mode: Mode, name: str, overrides: list[str], outputs: Path) -> dict:
    overrides = [*overrides, *shlex.split(mode.extra), f"outputs_dir={outputs}"]
    plan, resolved_yaml = compose_plan(overrides)
    run_dir = new_run_dir(outputs, prefix=name)
    prepare(run_dir, plan, resolved_yaml)
    result = launch(plan, run_dir, warm=mode.warm)
    row = {
        "config": name,
        "mode": mode.name,
        "status": result.status,
        "reason": result.reason[-300:],
        "wall_s": result.wall_s,
        "run_dir": str(run_dir),
    }
    if result.ok:
        assert result.metrics is not None  # an ok run has its metrics
        split = phases(result.metrics, result.wall_s)
        steps = result.metrics.step_time_s
        row |= {
            "phases_s": split,
            "timed_share": split["timed_steps"] / result.wall_s,
            "step_median_s": steps.median,
            "step_cv": steps.cv,
            "measured_steps": len(steps.steps),
            "stopped_by": steps.stopped_by,
            "warmup_steps": len(result.metrics.warmup_step_time_s or []),
        }
    return row


def summarize(rows: list[dict], mode_names: list[str]) -> dict[str, dict]:
    out = {}
    for mode in mode_names:
        mine = [r for r in rows if r["mode"] == mode]
        ok = [r for r in mine if r["status"] == "ok"]
        later = ok[1:]  # every trial after the first: a warm host's start is in the first trial
        total = sum(r["wall_s"] for r in mine)
        out[mode] = {
            "trials": len(mine),
            "ok": len(ok),
            "total_wall_s": total,
            "trials_per_hour": 3600 * len(mine) / total if total else None,
            "median_wall_s": statistics.median(r["wall_s"] for r in ok) if ok else None,
            "median_timed_share": statistics.median(r["timed_share"] for r in ok) if ok else None,
            "median_phases_s": {p: statistics.median(r["phases_s"][p] for r in ok) for p in PHASES} if ok else {},
            "max_imports_after_first_s": max((r["phases_s"]["imports"] for r in later), default=None),
        }
    before, now = mode_names
    if out[before]["total_wall_s"] and out[now]["total_wall_s"]:
        out["now_over_before_trials_per_hour"] = out[now]["trials_per_hour"] / out[before]["trials_per_hour"]
    return out


def fusion_verdicts(probes: list[dict]) -> dict[str, dict]:
    """Per fusion, the default (``fusions_auto``) against the default without it: the first warm-up step's extra
    seconds with it (its per-trial compile cost), the median step's saving, and whether the saving over the
    trial's warm-up and measured steps pays for the cost."""
    by_name = {r["config"]: r for r in probes if r["status"] == "ok"}
    auto = by_name.get("fusions_auto")
    if auto is None:
        return {}
    steps = auto["warmup_steps"] + auto["measured_steps"]
    out = {}
    for name, without in by_name.items():
        if name == "fusions_auto":
            continue
        cost = auto["phases_s"]["first_step"] - without["phases_s"]["first_step"]
        saving = without["step_median_s"] - auto["step_median_s"]
        out[name.removeprefix("without_")] = {
            "first_step_extra_s": cost,
            "step_saving_s": saving,
            "steps_per_trial": steps,
            "pays_for_itself": saving * steps >= cost,
        }
    return out


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{scale * value:.{digits}f}"


def table(rows: list[dict]) -> str:
    head = ["config", "mode", "wall", *PHASES, "timed %", "step ms", "steps"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(" | ".join([r["config"], r["mode"], f"{r['wall_s']:.1f}", r["status"], r["reason"][:60]]))
            continue
        p = r["phases_s"]
        lines.append(
            " | ".join(
                [
                    r["config"],
                    r["mode"],
                    f"{r['wall_s']:.1f}",
                    *(f"{p[k]:.2f}" for k in PHASES),
                    f"{100 * r['timed_share']:.1f}",
                    f"{1e3 * r['step_median_s']:.1f}",
                    f"{r['measured_steps']} ({r['stopped_by']})",
                ]
            )
        )
    return "\n".join(lines)


def summary_lines(summary: dict, mode_names: list[str]) -> str:
    lines = []
    for mode in mode_names:
        s = summary[mode]
        lines.append(
            f"{mode}: {s['ok']}/{s['trials']} ok, {s['total_wall_s']:.1f} s in all, "
            f"{_fmt(s['trials_per_hour'], digits=0)} trials/hour, median wall {_fmt(s['median_wall_s'])} s, "
            f"median timed share {_fmt(s['median_timed_share'], 100)}%, imports after the first trial <= "
            f"{_fmt(s['max_imports_after_first_s'], digits=2)} s"
        )
    if summary.get("host_start_failed"):
        lines.append(f"the warm host did not start (its trials ran fresh): {summary['host_start_failed']}")
    if "now_over_before_trials_per_hour" in summary:
        lines.append(f"now / before trials per hour: {summary['now_over_before_trials_per_hour']:.2f}x")
    for name, v in summary.get("fusions", {}).items():
        lines.append(
            f"{name}: first step +{v['first_step_extra_s']:.2f} s, step {1e3 * v['step_saving_s']:+.1f} ms saved "
            f"x {v['steps_per_trial']} steps: {'pays' if v['pays_for_itself'] else 'does not pay'} for itself"
        )
    return "\n".join(lines)


def write(out: Path, head: dict, rows: list[dict], probes: list[dict], mode_names: list[str], complete: bool) -> str:
    """The JSON at ``out`` with the trials so far and the summary of what finished (``write_result``: rewritten
    after every trial, ``complete`` once all ran); returns the table and summary as printed."""
    host_imports = next((h.imports_s for h in warm_host._hosts.values()), None)
    # A host that could not start (a CUDA context after its imports, say) leaves the warm trials fresh: say so.
    summary = summarize(rows, mode_names) | {
        "host_imports_s": host_imports,
        "host_start_failed": list(warm_host._failed_starts.values()),
        "fusions": fusion_verdicts(probes),
    }
    text = table(rows + probes) + "\n\n" + summary_lines(summary, mode_names)
    data = head | {
        "fusion_probes": FUSION_PROBES if probes else {},
        "summary": summary,
        "table": text,
        "rows": rows,
        "probes": probes,
    }
    write_result(out, data, complete=complete)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="cpu", help="cpu, or a GPU hardware group (h100, h200, ...)")
    parser.add_argument("--common", help="overrides of every config (default: the hardware's preset)")
    parser.add_argument(
        "--also", default="", help="overrides added to --common or the preset (train.trace_first_step=true)"
    )
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=OVERRIDES",
        help="a config to measure (repeatable; default: the hardware's preset)",
    )
    parser.add_argument(
        "--warm-host",
        choices=("default", "on", "off"),
        default="default",
        help="the now mode's trials: forked from a warm host or fresh (default: sweep.warm_host's default)",
    )
    parser.add_argument("--no-fusion-probes", action="store_true", help="skip the per-fusion probes on GPU")
    parser.add_argument(
        "--probes-only",
        action="store_true",
        help="only the per-fusion probes, --repeats rounds of them (the verdicts read the last round's)",
    )
    parser.add_argument("--only-mode", choices=("before", "now"), help="run the configs in this mode alone")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the configs")
    parser.add_argument("--workdir", help="where the modes' outputs directories go (default: a new temp dir)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    on_cpu = args.hardware == "cpu"
    if args.probes_only and (on_cpu or args.no_fusion_probes):
        parser.error("--probes-only runs the fusion probes, which need a GPU hardware group and no --no-fusion-probes")
    common, presets = PRESETS["cpu" if on_cpu else "gpu"]
    common = args.common if args.common is not None else f"{common} hardware={args.hardware}"
    common = f"{common} {args.also}".strip()
    configs = dict(c.split("=", 1) for c in args.config) or presets
    warm_now = {"default": SweepConf().warm_host, "on": True, "off": False}[args.warm_host]
    before, now = modes(args.hardware, warm_now)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="trial_cost-"))
    mode_names = [before.name, now.name]
    head = {
        "question": "Where does a trial's wall go, the way sweeps ran trials before against the way they run them now?",
        "command": shlex.join(["python", *sys.argv]),
        "git_commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "common": common,
        "configs": configs,
        "modes": {m.name: {"warm": m.warm, "extra": m.extra} for m in (before, now)},
    }
    rows: list[dict] = []
    probes: list[dict] = []
    for _ in range(0 if args.probes_only else args.repeats):
        for name, extra in configs.items():
            for mode in (m for m in (before, now) if args.only_mode in (None, m.name)):
                rows.append(row := run_one(mode, name, shlex.split(f"{common} {extra}"), root / mode.name))
                print(f"{name} {mode.name}: {row['status']} in {row['wall_s']:.1f} s", flush=True)
                write(Path(args.out), head, rows, probes, mode_names, complete=False)
    if not on_cpu and not args.no_fusion_probes:
        shape = next(iter(configs.values()))
        for _ in range(args.repeats if args.probes_only else 1):
            for name, extra in FUSION_PROBES.items():
                probes.append(row := run_one(now, name, shlex.split(f"{common} {shape} {extra}"), root / now.name))
                print(f"{name} {now.name}: {row['status']} in {row['wall_s']:.1f} s", flush=True)
                write(Path(args.out), head, rows, probes, mode_names, complete=False)
    text = write(Path(args.out), head, rows, probes, mode_names, complete=True)
    warm_host.close_hosts()
    print(text)
    return 0 if all(r["status"] == "ok" for r in rows + probes) else 1


if __name__ == "__main__":
    sys.exit(main())
