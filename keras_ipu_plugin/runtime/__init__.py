"""Turning the IR into Keras models and running them: rebuild, the
functional model class, wrapper layers, the executor, backends, distribution."""
