"""moe-vlm-sweep's Hydra sweeper: Optuna ask/tell over real, isolated training runs (see ``_impl``)."""
