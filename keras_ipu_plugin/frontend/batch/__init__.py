"""Batch generalisation: a `call` that computes with its batch size, traced at
two batch sizes (or multiples of a divisor) and made one graph for any batch size."""
