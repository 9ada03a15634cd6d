"""Modules with explicit backward, losses and optimizers on NumPy or CuPy arrays."""
