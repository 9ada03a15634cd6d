"""Collective backends: one file per backend behind backends.base.Backend."""
