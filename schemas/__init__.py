"""Pydantic models: user configs, data contracts, artifact references, errors."""
