"""Prefect flows, deployments and the command line: wiring only, no numerics."""
