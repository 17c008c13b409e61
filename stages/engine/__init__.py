"""Machinery shared by every stage kind: runner, registry, store, hashing, versions, tiles."""
