"""Layers for TensorFlow called on graph tensors: a TensorFlow function
(`tf_function.py`) and a TensorFlow random draw (`tf_random_draw.py`), both
resolved only from the explicit table of public, side-effect-free entries in
`tf_function_table.py`."""
