"""Experiment tracking. ``mlflow_sink`` is the only module of the project that imports mlflow."""
