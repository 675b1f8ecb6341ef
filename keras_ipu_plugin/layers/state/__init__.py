"""Layers for the model state a graph reads and writes: variable reads and
held constants (`reads.py`), variable writes and what must come after them
(`variable_write.py`), losses a `call` adds (`added_loss.py`), and a variable
held by a layer and a read or write node saved as one (`shared_variables.py`)."""
