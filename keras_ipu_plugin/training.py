"""Route a compiled model's `fit` / `evaluate` through its converted graph.

Used by `PluginCallback` and `kip.scope`, which must leave the user's model
object as it is: instead of changing the model, they give `fit` a train
function (Keras honours a `model.train_function` set before the first step)
that, at its first call, reads the first batch from the iterator `fit`
passes, converts the model, runs that batch, and from then on runs the
model's own `train_step` with the forward pass going through the converted
graph.
"""

import keras
import tensorflow as tf

from keras_ipu_plugin import _keras_internals


class ForwardProxy:
    """Stands in for `model` as `self` of its `train_step` / `test_step`:
    calling it runs the converted graph; every other attribute (optimizer,
    loss, metrics, sub-layers) is the model's own.

    Example:
        >>> proxy = ForwardProxy(model, converted)
        >>> type(model).train_step(proxy, data)   # forward through `converted`
    """

    def __init__(self, model, converted):
        object.__setattr__(self, "_kip_model", model)
        object.__setattr__(self, "_kip_converted", converted)

    def __call__(self, *args, **kwargs):
        return self._kip_converted(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._kip_model, name)

    def __setattr__(self, name, value):
        setattr(self._kip_model, name, value)


class LazyStepFunction:
    """A `train_function` / `test_function` that converts at its first call.

    `convert(first_batch_x)` returns the converted model. The batch it reads
    to convert is the batch it then runs: none is skipped or read twice.
    """

    def __init__(self, model, step_name, convert):
        self.model = model
        self.step_name = step_name
        self.convert = convert
        self.function = None

    def __call__(self, iterator):
        if self.function is not None:
            return self.function(iterator)
        try:
            data = iterator.get_next()
        except (tf.errors.OutOfRangeError, StopIteration):
            raise StopIteration
        x = keras.utils.unpack_x_y_sample_weight(_local(self.model, data))[0]
        converted = self.convert(x)
        proxy = ForwardProxy(self.model, converted)
        step = getattr(type(self.model), self.step_name)
        self.function = _keras_internals.make_step_function(
            self.model, lambda batch: step(proxy, batch)
        )
        return self.function([data])


def _local(model, data):
    """One replica's share of a (possibly distributed) batch."""
    strategy = model.distribute_strategy
    return tf.nest.map_structure(
        lambda v: strategy.experimental_local_results(v)[0], data
    )
