"""Hydra's shared contract for sweepers/launchers, run against this sweeper, plus plugin discovery.

``IntegrationTestSuite`` runs a throwaway Hydra app in a subprocess with ``-m`` and our sweeper selected; the
app is not moe-vlm-sweep's, so the sweeper uses its generic trial (the task's return value, no MLflow).
"""

from __future__ import annotations

import pytest
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite

from hydra_plugins.moe_vlm_sweep_sweeper.moe_vlm_sweeper import MoeVlmSweeper


def test_discovery():
    assert MoeVlmSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]


@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [
    ({"defaults": [{"override hydra/sweeper": "moe_vlm_sweep"}, "_self_"], "sweep": {"n_trials": 1}}, ["-m"]),
])
class TestMoeVlmSweeperIntegration(IntegrationTestSuite):
    pass
