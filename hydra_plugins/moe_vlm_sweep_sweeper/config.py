"""The sweeper's ConfigStore entry (``hydra/sweeper=moe_vlm_sweep``, selected by every ``sweep=<space>``).

The sweeper's own node holds only the target: every setting of a sweep lives in the typed ``sweep`` node
(``moe_vlm_sweep.sweep.spec.SweepConf``), so each knob is written once and overridden as ``sweep.<knob>``.

No ``from __future__ import annotations`` here: Hydra's plugin scan executes this module before it is in
``sys.modules``, where string annotations break ``@dataclass``.
"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from moe_vlm_sweep.sweep.spec import SweepConf


@dataclass
class MoeVlmSweeperConf:
    _target_: str = "hydra_plugins.moe_vlm_sweep_sweeper.moe_vlm_sweeper.MoeVlmSweeper"


ConfigStore.instance().store(
    group="hydra/sweeper", name="moe_vlm_sweep", node=MoeVlmSweeperConf, provider="moe_vlm_sweep"
)
# The schema every space file starts from (``defaults: [sweep_schema, ...]``), so each SweepConf field exists in
# the composed ``sweep`` node and ``sweep.storage=...`` works even where the space file does not mention it.
ConfigStore.instance().store(group="sweep", name="sweep_schema", node=SweepConf, provider="moe_vlm_sweep")
