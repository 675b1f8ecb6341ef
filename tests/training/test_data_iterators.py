"""The plugin's own tf.data iterators cost nothing to delete, and it keeps
none of the user's.

An autotuned tf.data iterator runs a tuning thread; deleting the iterator
can wait for that thread's sleep, which grows to a minute as the iterator
ages (seen with gdb in this suite: a third of its time). So the plugin's
one-batch peeks are not autotuned, and the training step does not hold the
epoch's iterator after the epoch (Python's cyclic collector would delete it
at some unrelated later moment).
"""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.data.ops import iterator_ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.inputs import without_autotuning

#: A feature width no other test uses, to find this module's iterators.
WIDTH = 13


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def _dataset():
    x = np.random.RandomState(0).normal(size=(16, WIDTH)).astype("float32")
    y = np.zeros((16, 2), "float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(4)


def _live_iterators_of_this_module():
    gc.collect()
    return [
        obj for obj in gc.get_objects()
        if isinstance(obj, iterator_ops.OwnedIterator)
        and tf.nest.flatten(obj.element_spec)[0].shape[-1] == WIDTH
    ]


def test_a_peek_without_autotuning_gives_the_same_batches():
    dataset = _dataset()
    peek = without_autotuning(dataset)
    assert peek.options().autotune.enabled is False
    assert dataset.options().autotune.enabled is not False  # the user's is unchanged
    for ours, theirs in zip(peek, dataset):
        np.testing.assert_array_equal(ours[0], theirs[0])


def test_converting_from_a_dataset_leaves_its_options_as_they_were():
    dataset = _dataset()
    model = Net()
    converted = kip.convert_to_functional(model, dataset)
    assert converted is not None
    assert dataset.options().autotune.enabled is not False


@pytest.mark.parametrize("entry", ["PluginModel", "PluginCallback"])
def test_training_keeps_no_epoch_iterator_alive_after_fit(entry):
    assert not _live_iterators_of_this_module()
    model = Net()
    if entry == "PluginModel":
        trained = kip.PluginModel(model)
        trained.compile("sgd", "mse")
        trained.fit(_dataset(), epochs=2, verbose=0)
    else:
        trained = model
        trained.compile("sgd", "mse")
        trained.fit(_dataset(), epochs=2, verbose=0, callbacks=[kip.PluginCallback()])
    # The model (and its train function) lives on; the iterators do not.
    assert trained.train_function is not None
    assert not _live_iterators_of_this_module()
