"""Layers for `keras.ops` calls a graph holds with graph values where Keras
takes Python values: a batch-sized argument (`batch_sized.py`), a size given
as a graph tensor (`tensor_sized.py`), a `keras.random` draw with its seed
generator (`random_draws.py`), and a Keras mask put on a tensor (`masks.py`)."""
