"""Collective backends: one package per backend behind backends.base.Backend, and what they all share."""
