"""Checkpoint format readers and writers; each imports its framework (torch, jax, orbax) lazily."""
