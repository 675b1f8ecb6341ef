"""Verification: the converted model computes what the original computes
(outputs, gradients and a training step's writes, compared on the first batch)."""
