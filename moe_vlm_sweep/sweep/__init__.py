"""The sweep layer: search spaces, the trial lifecycle, resume; driven by the Hydra sweeper plugin.

The plugin (``hydra_plugins/moe_vlm_sweep_sweeper``) is Hydra plumbing only; what a trial is, how it is
validated, counted, deduplicated and recovered lives here, so it is testable without Hydra's machinery.
"""
