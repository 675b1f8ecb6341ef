"""Symbolic idioms Keras rejects, followed while a trace runs (trace-time patches,
`tf.TensorArray`, TensorFlow functions on symbolic tensors)."""
