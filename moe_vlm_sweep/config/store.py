"""ConfigStore registration only: each group's schema is the base its YAML options extend."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from moe_vlm_sweep.config import schema

GROUP_SCHEMAS = {
    "model": schema.ModelConf,
    "parallel": schema.ParallelConf,
    "batch": schema.BatchConf,
    "recompute": schema.RecomputeConf,
    "cuda_graph": schema.CudaGraphConf,
    "dispatcher": schema.DispatcherConf,
    "vision": schema.VisionTrainingConf,
    "fusions": schema.FusionsConf,
    "data": schema.DataConf,
    "hardware": schema.HardwareConf,
    "launcher": schema.LauncherConf,
    "tracking": schema.TrackingConf,
    "train": schema.TrainConf,
}


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(name="run_config_schema", node=schema.RunConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)
