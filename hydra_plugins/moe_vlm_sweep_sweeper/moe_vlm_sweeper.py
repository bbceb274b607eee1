"""The public Sweeper class: cheap to import (Hydra imports it to discover plugins); the work is in ``_impl``."""

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from .config import MoeVlmSweeperConf  # noqa: F401  (registers hydra/sweeper=moe_vlm_sweep)


class MoeVlmSweeper(Sweeper):
    def __init__(self) -> None:
        self._impl: Any | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from ._impl import SweeperImpl

        self._impl = SweeperImpl()
        self._impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        assert self._impl is not None, "setup() must run before sweep()"
        return self._impl.sweep(arguments)
