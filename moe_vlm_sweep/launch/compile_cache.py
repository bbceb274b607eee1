"""Where torch.compile (inductor) and Triton keep compiled kernels: one directory per machine and library
versions under the outputs directory, shared by every run there, so a kernel compiled by one trial is loaded by
the next instead of compiled again (the H100 measurement in ``benchmarks/results/README.md``: the first warm-up
step of a fused run took 44 s with empty caches, 19 s with the previous run's).

Per machine, because Triton tunes its kernels to the GPU it compiled on and a shared filesystem may serve
several kinds of node; per versions, because a cache written by another torch or Triton is at best unused. The
user's own ``TORCHINDUCTOR_CACHE_DIR``/``TRITON_CACHE_DIR`` win.

Triton's autotuner benchmarks every candidate config of an autotuned kernel once per process unless
``TRITON_CACHE_AUTOTUNING=1`` (Triton 3.2+) keeps its choice in the same cache: Transformer Engine's MoE
permutation (``fusions.moe_permute``, on by default on GPU) is such a kernel, so without it every trial pays the
tuning again in its first step. The user's own value wins here too (``0`` tunes in every process).
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

CACHE_ENVS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
SETTINGS = {"TRITON_CACHE_AUTOTUNING": "1"}
_VERSIONED = ("torch", "triton", "pytorch-triton", "transformer_engine", "megatron-core")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def cache_key(hardware: str) -> str:
    """``<host>-<hardware>-torch<v>-triton<v>...``: the libraries that are installed, in a path-safe form."""
    parts = [platform.node() or "host", hardware]
    parts += [f"{name}{v}" for name in _VERSIONED if (v := _version(name))]
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", "-".join(parts))


def cache_env(outputs_dir: str | Path, hardware: str, inherited: Mapping[str, str]) -> dict[str, str]:
    """The cache variables a run gets (absolute paths: a trial may run in another working directory)."""
    root = Path(outputs_dir).resolve() / "compile_cache" / cache_key(hardware)
    dirs = {env: inherited.get(env) or str(root / sub) for env, sub in CACHE_ENVS.items()}
    return dirs | {env: inherited.get(env) or value for env, value in SETTINGS.items()}
