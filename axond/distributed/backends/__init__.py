"""Collective backends: one module or package per backend behind backends.base.Backend."""
