"""The parallel layout a config asks for: group sizes, what data parallelism the world leaves, the sequence as split.

Shared by the rules, the memory estimate and the plan, so the arithmetic lives once.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_vlm_sweep.config.schema import RunConfig


@dataclass(frozen=True, kw_only=True)
class Layout:
    world_size: int
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int
    dp: int
    """Data-parallel size of the dense part: world / (tp * pp * cp)."""
    edp: int
    """Expert data-parallel size: world / (etp * ep * pp)."""
    sp: bool

    def megatron_sizes(self) -> dict[str, int | None]:
        """The layout in megatron-core's keywords, as ``initialize_model_parallel`` and ``TransformerConfig``
        both take them (no VPP is ``None``, not 1)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp if self.vpp > 1 else None,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
        }


def layout_of(cfg: RunConfig) -> Layout:
    p, world = cfg.parallel, cfg.launcher.world_size
    return Layout(
        world_size=world,
        tp=p.tp,
        pp=p.pp,
        vpp=p.vpp,
        cp=p.cp,
        ep=p.ep,
        etp=p.etp,
        dp=max(world // (p.tp * p.pp * p.cp), 1),
        edp=max(world // (p.etp * p.ep * p.pp), 1),
        sp=p.sp,
    )


def seq_padding_factor(cfg: RunConfig) -> int:
    """LLaVA pads the combined sequence so that SP (tp) and CP (2*cp, load-balanced) can split it evenly."""
    p = cfg.parallel
    return (p.tp if p.sp else 1) * (2 * p.cp if p.cp > 1 else 1)


def sharded_seq_length(cfg: RunConfig) -> int:
    """The decoder sequence as LLaVA feeds it to the layers: padded to ``seq_padding_factor``."""
    factor = seq_padding_factor(cfg)
    return -(-cfg.model.seq_length // factor) * factor
