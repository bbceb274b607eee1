"""Best trials of a study -> files a person reuses: Hydra overrides, an experiment config, a command line."""
