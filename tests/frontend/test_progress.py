"""Progress: a conversion made for `fit` says what it did and how long it
took, one line per step, when `fit`'s `verbose` is on, as Keras's own
progress bar does."""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        return x + self.dense(x)


class Net(keras.Model):
    def __init__(self):
        super().__init__(name="net")
        self.block, self.head = Block(), keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


X = np.random.default_rng(0).random((16, 4)).astype("float32")
Y = X.sum(axis=1, keepdims=True)


def _fit(entry, verbose, capsys):
    passes = [kip.passes.Expand()]
    if entry == "plugin_model":
        model = kip.PluginModel(Net(), passes=passes)
        callbacks = []
    else:
        model, callbacks = Net(), [kip.PluginCallback(passes=passes)]
    model.compile(optimizer="sgd", loss="mse")
    capsys.readouterr()
    model.fit(X, Y, batch_size=8, epochs=1, verbose=verbose, callbacks=callbacks)
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("kip: ")]


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_a_verbose_fit_prints_one_timed_line_per_step(entry, capsys):
    lines = _fit(entry, 1, capsys)
    steps = [line.split()[1] for line in lines]
    assert steps == ["convert", "verify", "expand", "verify"], lines
    assert all(line.endswith(" s") for line in lines)
    seconds = [float(line.rsplit(" in ", 1)[1][:-2]) for line in lines]
    assert all(s >= 0 for s in seconds)


@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_a_quiet_fit_prints_nothing_of_the_plugin(entry, capsys):
    assert _fit(entry, 0, capsys) == []


def test_the_report_keeps_the_timings_of_convert_and_apply_passes():
    converted = kip.convert_to_functional(Net(), X)
    passed = kip.apply_passes(converted, [kip.passes.Expand()])
    assert [step for step, _, _ in passed.kip_report.timings] == [
        "convert", "verify", "expand", "verify"]
