"""One conversion at a time in a process.

Converting writes bookkeeping on the user's layers and takes it back: the
nodes a symbolic call records on each layer, its build state, the values a
verification run moves. Two threads converting the same model interleave
those writes and fail ("name 'input' used 2 times", IndexError, "Graph
disconnected"), and so do two *different* models that share a layer (a
siamese encoder, one backbone under two heads): a lock per model cannot
see that, so the lock is process-wide. Conversions are rare and spend
nearly all their time in Python holding the GIL, so serialising them costs
no real parallelism.

Calling a converted model, or training it, takes no lock. Converting a
model while another thread trains it is not supported: the conversion puts
the model's non-trainable variables back to their values from before it
(see `state.ModelState`), which would undo that thread's updates.
"""

import threading

# Re-entrant: a rebuild converts and then applies passes, each taking it.
_CONVERSION_LOCK = threading.RLock()


def one_conversion_at_a_time():
    """The lock every conversion, rebuild and `apply_passes` holds while it
    traces, rebuilds or verifies a user's model.

    Example:
        >>> with one_conversion_at_a_time():
        ...     graph = trace_model(model, specs)
    """
    return _CONVERSION_LOCK


__all__ = ["one_conversion_at_a_time"]
