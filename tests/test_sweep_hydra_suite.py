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


@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [
        ({"defaults": [{"override hydra/sweeper": "moe_vlm_sweep"}, "_self_"], "sweep": {"n_trials": 1}}, ["-m"]),
    ],
)
class TestMoeVlmSweeperIntegration(IntegrationTestSuite):
    pass


APP = """
import hydra


@hydra.main(version_base="1.3", config_path=".", config_name="config")
def main(cfg):
    return float(cfg.a) + (0.5 if cfg.b == "y" else 0.0)


if __name__ == "__main__":
    main()
"""

CONFIG = """
defaults:
  - override hydra/sweeper: moe_vlm_sweep
  - _self_
a: 1
b: x
sweep:
  n_trials: 6
  sampler: random
  seed: 3
  objective: {metric: value, direction: maximize}
  params:
    a: [1, 2, 3]
    b: [x, y]
"""


def test_after_a_repeated_config_the_sweep_walks_one_knob_out_from_the_best(tmp_path):
    """A generic Hydra app, a random sampler that repeats itself in a 6-config space: each repeat is followed by
    an untried config one knob from the best so far, while there is one, and no config runs twice."""
    import re
    import subprocess
    import sys

    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(CONFIG)
    out = subprocess.run(
        [sys.executable, "app.py", "-m"], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=True
    ).stdout
    lines = re.findall(
        r"^\[trial \d+/6\] #(\d+) a=(\d) b=(\w)(?: \(one knob from best trial #(\d+)\))? -> (\w+)", out, re.M
    )
    assert len(lines) > 6, out  # the seeded sampler repeats itself
    configs = {int(number): (a, b) for number, a, b, _, _ in lines}
    value = {n: int(a) + (0.5 if b == "y" else 0.0) for n, (a, b) in configs.items()}  # the app's, all distinct
    walked = 0
    for i, (_, a, b, best, _) in enumerate(lines):
        if not best:
            continue
        walked += 1
        best_so_far = max((int(n) for n, *_, result in lines[:i] if result == "ok"), key=value.__getitem__)
        assert int(best) == best_so_far, (lines[: i + 1], best)
        best_a, best_b = configs[int(best)]
        assert (a != best_a) + (b != best_b) == 1, (a, b, configs[int(best)])
    assert walked, out
    ran = [(a, b) for _, a, b, _, result in lines if result == "ok"]
    assert len(ran) == len(set(ran)) == 6
