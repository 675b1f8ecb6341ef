"""Tests for `kip.convert_to_functional` (first-batch conversion
with verification).

Every test compares against the behaviour of the original subclassed model,
so it fails if the converted model computes something else, holds copies of
the variables, drops a `training` value or a mask, or if a failed conversion
leaves the user's model altered.
"""

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_ipu_plugin as kip
from keras_ipu_plugin.ir.graph import FOLLOW

import models as zoo  # tests/models.py (tests/ is on sys.path under pytest)
from graph_checks import Snapshot, all_layers, assert_close, assert_equivalent


# -- helpers -------------------------------------------------------------------
def assert_shares_variables(original, converted):
    """The converted model holds the very variable objects of the original."""
    assert len(converted.weights) == len(original.weights)
    for variable in converted.weights:
        assert any(variable is mine for mine in original.weights), variable.path
    for variable in original.weights:
        assert any(variable is theirs for theirs in converted.weights), variable.path



def no_opaque(converted):
    assert converted.kip_report.opaque == {}
    assert not any(isinstance(l, kip.OpaqueLayer) for l in converted.layers)


def targets_for(outputs):
    """Training targets with the structure and shapes of `outputs`."""
    return keras.tree.map_structure(
        lambda t: np.random.RandomState(7).normal(size=t.shape).astype("float32"),
        outputs,
    )


# -- equivalence -------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(zoo.TRACEABLE))
def test_outputs_and_gradients_match(name):
    model, x = zoo.TRACEABLE[name]()
    converted = kip.convert_to_functional(model, x)
    assert isinstance(converted, kip.KipFunctional)
    no_opaque(converted)
    kip.frontend.verify.equivalence.check_equivalent(model, converted, zoo.as_tensor(x))
    assert_equivalent(model, converted, x)
    assert_shares_variables(model, converted)


@pytest.mark.parametrize("name", ["cnn", "dict"])
def test_converted_model_accepts_other_batch_sizes(name):
    model, x = zoo.TRACEABLE[name]()
    converted = kip.convert_to_functional(model, x)
    smaller = keras.tree.map_structure(lambda a: a[:3], x)
    assert_equivalent(model, converted, smaller)


def test_training_flag_reaches_dropout():
    model, x = zoo.make_mlp()
    converted = kip.convert_to_functional(model, x)
    inference = converted(x, training=False)
    assert_close(converted(x, training=False), inference, "inference is deterministic")
    dropped = converted(x, training=True)
    assert not np.allclose(dropped, inference), "Dropout ignored training=True"
    assert_close(converted(x), inference, "training defaults to inference")
    assert converted.kip_graph.node(model.dropout.name).training == FOLLOW


class DropoutNoTrainingArgument(keras.Model):
    """A `call` without `training`: Keras's `fit` calls it as `model(x)`, so
    its Dropout runs in inference mode."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8)
        self.dropout = keras.layers.Dropout(0.5)
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.dropout(self.dense(x)))


class DropoutWithTrainingArgument(DropoutNoTrainingArgument):
    def call(self, x, training=None):
        return self.head(self.dropout(self.dense(x), training=training))


def _fit_losses(model, x, y):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return history.history["loss"], [w.numpy() for w in model.trainable_weights]


@pytest.mark.parametrize("model_class", [DropoutNoTrainingArgument,
                                         DropoutWithTrainingArgument])
@pytest.mark.parametrize("how", ["converted", "expanded", "loaded"])
def test_a_converted_model_fits_as_the_original_calls_training(model_class, how, tmp_path):
    """`converted.fit` puts Dropout in the mode `model.fit` puts it in: off
    for a `call` without `training` (it was on, a silently other training),
    on for one with it; after `apply_passes` and a save / load too."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(7)
        model = model_class()
        model(x[:8])
        return model

    expected_losses, expected_weights = _fit_losses(build(), x, y)
    model = build()
    converted = kip.convert_to_functional(model, x[:8])
    takes = model_class is DropoutWithTrainingArgument
    assert converted.kip_call_takes_training is takes
    if how == "expanded":
        converted = kip.apply_passes(converted, [kip.passes.Expand("all")])
    if how == "loaded":
        converted.save(tmp_path / "m.keras")
        converted = keras.models.load_model(tmp_path / "m.keras")
    assert converted.kip_call_takes_training is takes
    keras.utils.set_random_seed(7)  # the same dropout masks as the plain fit's
    losses, weights = _fit_losses(converted, x, y)
    if how == "loaded" and takes:
        # A loaded Dropout draws from a new seed generator: its masks are
        # not the plain fit's, but it must be on (the fit without it differs).
        def without_dropout():
            keras.utils.set_random_seed(7)
            plain = DropoutNoTrainingArgument()
            plain(x[:8])
            return plain

        assert not np.allclose(losses, _fit_losses(without_dropout(), x, y)[0])
        return
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    for got, want in zip(weights, expected_weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_saved_call_takes_training_that_is_not_a_bool_is_refused(tmp_path):
    model, x = zoo.make_mlp()
    converted = kip.convert_to_functional(model, x)
    config = converted.get_config()
    config["kip_call_takes_training"] = "yes"
    with pytest.raises(kip.LoadError, match="kip_call_takes_training"):
        kip.KipFunctional.from_config(config)


def test_training_flag_reaches_batch_normalization():
    """In training mode BN normalises with batch statistics and updates its
    moving statistics: the converted model must do both, like the original."""
    model, x = zoo.make_cnn()
    converted = kip.convert_to_functional(model, x)
    stats = [v for v in model.non_trainable_variables if "moving" in v.path]
    assert len(stats) == 10
    before = [v.numpy().copy() for v in stats]

    expected = model(x, training=True).numpy()
    expected_stats = [v.numpy().copy() for v in stats]
    for variable, value in zip(stats, before):
        variable.assign(value)

    actual = converted(x, training=True).numpy()
    assert_close(actual, expected, "training-mode output")
    assert not np.allclose(actual, converted(x, training=False))
    for variable, old, new in zip(stats, before, expected_stats):
        assert not np.array_equal(variable.numpy(), old), variable.path
        assert_close(variable.numpy(), new, variable.path)


def test_training_mode_outputs_match_for_cnn():
    model, x = zoo.make_cnn()
    converted = kip.convert_to_functional(model, x)
    assert_equivalent(model, converted, x, training=True)


def test_fixed_training_argument():
    model, x = zoo.make_mlp()
    converted = kip.convert_to_functional(model, x, training=False)
    assert_close(converted(x, training=True), model(x, training=False), "pinned")
    with pytest.raises(ValueError, match="training"):
        kip.convert_to_functional(model, x, training="yes")


def test_transformer_mask_is_used():
    """Equality with the original only proves masking survives conversion if
    the mask changes the result: check that first."""
    model, tokens = zoo.make_transformer()
    converted = kip.convert_to_functional(model, tokens)
    embedded = tf.identity(model.embedding(tokens))  # drops the Keras mask
    unmasked = model.head(model.pool(model.block(embedded, mask=None)))
    assert not np.allclose(unmasked, model(tokens)), "the mask changes nothing"
    assert_equivalent(model, converted, tokens)


def test_rnn_mask_is_used():
    model, tokens = zoo.make_rnn()
    converted = kip.convert_to_functional(model, tokens)
    unmasked = model.head(model.gru(tf.identity(model.embedding(tokens))))
    assert not np.allclose(unmasked, model(tokens)), "the mask changes nothing"
    assert_equivalent(model, converted, tokens)


def test_nested_layers_are_traced_as_nodes():
    model, x = zoo.make_nested()
    converted = kip.convert_to_functional(model, x)
    names = [node.name for node in converted.kip_graph.nodes]
    assert names == ["outer", "head"]  # the attributes, whatever Keras named the layers
    assert converted.get_layer(model.outer.name) is model.outer
    assert converted.kip_layer("outer") is model.outer
    assert_equivalent(model, converted, x)


# -- shared variables ------------------------------------------------------------
def test_variables_are_the_same_objects_not_copies():
    model, x = zoo.make_cnn()
    converted = kip.convert_to_functional(model, x)
    assert_shares_variables(model, converted)
    for mine, theirs in zip(model.trainable_variables, converted.trainable_variables):
        assert mine is theirs
    # Assigning through the original changes what the converted model computes.
    kernel = model.head.kernel
    kernel.assign(kernel.numpy() * 2.0)
    assert_close(converted(x), model(x), "after assign")


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "dict"])
def test_original_matches_after_training_converted(name):
    """Five optimizer steps on the converted model train the original's
    variables: no stale copy anywhere (outputs and input-gradients agree)."""
    model, x = zoo.TRACEABLE[name]()
    converted = kip.convert_to_functional(model, x)
    before = [v.numpy().copy() for v in model.trainable_variables]
    y = targets_for(converted(x))
    loss = keras.tree.map_structure(lambda _: "mse", y)
    converted.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
    history = converted.fit(x, y, batch_size=len(tf.nest.flatten(x)[0]), epochs=5,
                            verbose=0, shuffle=False)
    assert len(history.history["loss"]) == 5
    assert converted.optimizer.iterations.numpy() == 5
    changed = [
        not np.array_equal(v.numpy(), b)
        for v, b in zip(model.trainable_variables, before)
    ]
    assert all(changed), [v.path for v, c in zip(model.trainable_variables, changed) if not c]
    assert_equivalent(model, converted, x)
    kip.frontend.verify.equivalence.check_equivalent(model, converted, zoo.as_tensor(x))


# -- inputs: names, dtypes, batch dimension --------------------------------------
def test_dict_input_names_and_dtypes_follow_x():
    model, x = zoo.make_dict_model()
    converted = kip.convert_to_functional(model, x)
    specs = {t.name: t for t in converted.inputs}
    assert set(specs) == {"features", "tokens"}
    assert specs["tokens"].dtype == "int64", "int token ids must stay int"
    assert specs["features"].dtype == "float32"
    assert tuple(specs["tokens"].shape) == (None, 7)
    assert tuple(specs["features"].shape) == (None, 5)
    out = converted(x)
    assert set(out) == {"score", "label"}


def test_int_and_string_inputs_keep_their_dtype():
    model, tokens = zoo.make_transformer()
    converted = kip.convert_to_functional(model, tokens)
    assert converted.inputs[0].dtype == "int32"
    model, words = zoo.make_string()
    converted = kip.convert_to_functional(model, words)
    assert converted.inputs[0].dtype == "string"
    assert_close(converted(tf.constant(words)), model(tf.constant(words)), "strings")


def test_float64_data_becomes_floatx():
    model, x = zoo.make_mlp()
    converted = kip.convert_to_functional(model, x.astype("float64"))
    assert converted.inputs[0].dtype == keras.config.floatx()


def test_list_and_tuple_inputs_and_outputs():
    model, x = zoo.make_tuple_model()
    converted = kip.convert_to_functional(model, x)
    assert [t.name for t in converted.inputs] == ["input_0", "input_1"]
    out = converted(x)
    assert isinstance(out, tuple) and len(out) == 2
    model, x = zoo.make_tuple_model(as_list=True)
    converted = kip.convert_to_functional(model, x)
    out = converted(x)
    assert isinstance(out, list) and len(out) == 2
    assert_equivalent(model, converted, x)


def test_batch_dimension_is_none_by_default():
    model, x = zoo.make_dict_model()
    converted = kip.convert_to_functional(model, x)
    assert all(t.shape[0] is None for t in converted.inputs)


def test_static_batch_without_strategy():
    model, x = zoo.make_dict_model(batch=6)
    converted = kip.convert_to_functional(model, x, static_batch=True)
    assert [t.shape[0] for t in converted.inputs] == [6, 6]
    assert_equivalent(model, converted, x)


def test_static_batch_is_per_replica_under_mirrored(mirrored):
    assert mirrored.num_replicas_in_sync == 2
    with mirrored.scope():
        model, x = zoo.make_mlp(batch=8)
        converted = kip.convert_to_functional(model, x, static_batch=True)
        assert tuple(converted.inputs[0].shape) == (4, 6)
        assert_shares_variables(model, converted)
        converted.compile(optimizer="sgd", loss="mse")
        before = model.head.kernel.numpy().copy()
        converted.fit(x, np.ones((8, 3), "float32"), batch_size=8, epochs=2, verbose=0)
    assert not np.array_equal(model.head.kernel.numpy(), before)
    with mirrored.scope():
        unfixed = kip.convert_to_functional(model, x)
    assert unfixed.inputs[0].shape[0] is None


def test_static_batch_from_distributed_dataset(mirrored):
    with mirrored.scope():
        model, x = zoo.make_mlp(batch=8)
    dataset = mirrored.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(x).batch(8)
    )
    # The dataset's elements are already one replica's share each.
    for scope in (mirrored.scope(), _no_scope()):
        with scope:
            converted = kip.convert_to_functional(model, dataset, static_batch=True)
        assert tuple(converted.inputs[0].shape) == (4, 6)


def test_static_batch_needs_a_divisible_batch(mirrored):
    with mirrored.scope():
        model, x = zoo.make_mlp(batch=7)
        model(x)
        snapshot = Snapshot(model)
        with pytest.raises(kip.InputDataError, match="not divisible by the 2 replicas"):
            kip.convert_to_functional(model, x, static_batch=True)
    snapshot.assert_unchanged()


class _no_scope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- every data form ------------------------------------------------------------
def _mlp_forms():
    _, x = zoo.make_mlp()
    y = np.ones((8, 3), "float32")
    sw = np.linspace(0.5, 1.5, 8).astype("float32")
    slices = tf.data.Dataset.from_tensor_slices
    return x, {
        "numpy": x,
        "tensor": tf.constant(x),
        "variable": tf.Variable(x),
        "x_only_tuple": (x,),
        "x_y": (x, y),
        "x_y_sw": (x, y, sw),
        "tensor_x_y": (tf.constant(x), tf.constant(y)),
        "dataset_x": slices(x).batch(8),
        "dataset_x_y": slices((x, y)).batch(8),
        "dataset_x_y_sw": slices((x, y, sw)).batch(8),
        "dataset_mapped": slices(x).batch(8).map(lambda a: a * 1.0).prefetch(1),
        "dataset_padded": slices(x).padded_batch(8),
    }


@pytest.mark.parametrize("form", sorted(_mlp_forms()[1]))
def test_every_data_form_of_one_input(form):
    x, forms = _mlp_forms()
    model, _ = zoo.make_mlp()
    converted = kip.convert_to_functional(model, forms[form])
    assert tuple(converted.inputs[0].shape) == (None, 6)
    assert converted.inputs[0].dtype == "float32"
    assert_equivalent(model, converted, x)


def test_structured_data_forms():
    model, x = zoo.make_dict_model()
    y = {"score": np.ones((6, 1), "float32"), "label": np.ones((6, 3), "float32")}
    slices = tf.data.Dataset.from_tensor_slices
    for data in (x, (x, y), slices(x).batch(3), slices((x, y)).batch(6)):
        converted = kip.convert_to_functional(model, data)
        assert {t.name: t.dtype for t in converted.inputs} == {
            "features": "float32", "tokens": "int64"
        }
        assert_equivalent(model, converted, x)

    model, pair = zoo.make_tuple_model()
    y = np.ones((6, 2), "float32")
    # A tuple is (x, y, sample_weight) by Keras's convention, so a tuple x
    # travels as (x,) or (x, y); tf.data turns lists into tuples.
    for data in ((tuple(pair),), (pair, y), slices((tuple(pair), y)).batch(6)):
        converted = kip.convert_to_functional(model, data)
        assert [t.name for t in converted.inputs] == ["input_0", "input_1"]
        assert_equivalent(model, converted, pair)


def test_dataset_of_strings_keeps_strings():
    model, words = zoo.make_string()
    dataset = tf.data.Dataset.from_tensor_slices((words, np.zeros(4))).batch(4)
    converted = kip.convert_to_functional(model, dataset)
    assert converted.inputs[0].dtype == "string"


def test_dataset_is_not_consumed():
    """The first batch is read from a fresh iterator: the dataset (even one
    fed by a Python generator) still yields every batch, first one first,
    and `fit` afterwards runs over all of them."""
    model, x = zoo.make_mlp(batch=12)
    y = np.arange(12, dtype="float32").reshape(12, 1).repeat(3, axis=1)
    started = []

    def rows():
        started.append(True)
        yield from zip(x, y)

    dataset = tf.data.Dataset.from_generator(
        rows,
        output_signature=(
            tf.TensorSpec((6,), tf.float32), tf.TensorSpec((3,), tf.float32)
        ),
    ).batch(4)
    first_before = next(iter(dataset))
    converted = kip.convert_to_functional(model, dataset)
    batches = list(dataset)
    assert len(batches) == 3
    np.testing.assert_array_equal(batches[0][0], first_before[0])
    np.testing.assert_array_equal(batches[0][1], y[:4])
    np.testing.assert_array_equal(np.concatenate([b[1] for b in batches]), y)

    seen = []
    converted.compile(optimizer="sgd", loss="mse")

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(batch)

    converted.fit(dataset, epochs=1, verbose=0, callbacks=[Count()])
    assert seen == [0, 1, 2]


def test_py_dataset():
    class Batches(keras.utils.PyDataset):
        def __init__(self, x):
            super().__init__()
            self.x = x

        def __len__(self):
            return 2

        def __getitem__(self, index):
            part = self.x[index * 4 : (index + 1) * 4]
            return part, np.zeros((len(part), 3), "float32")

    model, x = zoo.make_mlp()
    data = Batches(x)
    converted = kip.convert_to_functional(model, data)
    assert tuple(converted.inputs[0].shape) == (None, 6)
    np.testing.assert_array_equal(data[0][0], x[:4])


def test_functional_and_sequential_models_are_rewired():
    sequential = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                   keras.layers.Dense(2)])
    x = np.random.rand(5, 4).astype("float32")
    converted = kip.convert_to_functional(sequential, x)
    assert converted is not sequential
    assert_shares_variables(sequential, converted)
    assert_equivalent(sequential, converted, x)


# -- dynamic (opaque) ----------------------------------------------------------
def test_dynamic_branch_model_becomes_opaque_and_matches_both_branches():
    model, x = zoo.make_dynamic(value=0.2)
    converted = kip.convert_to_functional(model, x)
    report = converted.kip_report
    assert list(report.opaque) == [model.name]
    assert "boolean" in report.opaque[model.name]
    opaque = [l for l in converted.layers if isinstance(l, kip.OpaqueLayer)]
    assert len(opaque) == 1 and opaque[0].layer is model
    assert model.name in str(report) and "kept as one node" in str(report)
    # The branch the first batch did not take is built too (before any
    # optimizer sees the model), and the converted model takes it as well.
    assert model.layer1.built
    assert_shares_variables(model, converted)
    assert len(model.trainable_variables) == 4
    for value in (0.2, 0.02):
        other = np.full((4, 1), value, "float32")
        assert_equivalent(model, converted, other)
        kip.frontend.verify.equivalence.check_equivalent(model, converted, other)
    assert not np.allclose(converted(np.full((4, 1), 0.02, "float32")),
                           model.dense_layer(np.full((4, 1), 0.02, "float32")))


def test_a_branch_on_a_tensor_value_is_reported_with_the_line_that_branches():
    # The reason was Keras's "A symbolic KerasTensor cannot be used as a
    # boolean" alone: which line, and what to do, was left to guess.
    import inspect

    model, x = zoo.make_dynamic(value=0.2)
    reason = kip.convert_to_functional(model, x).kip_report.opaque[model.name]
    source, first = inspect.getsourcelines(zoo.DynamicBranchModel.call)
    line = first + next(i for i, text in enumerate(source) if "if inputs[0] > 0.1:" in text)
    assert f"models.py:{line}: if inputs[0] > 0.1:" in reason, reason
    assert "Python control flow" in reason and "ops.where" in reason


def _fit_dynamic(converted, model):
    x = np.concatenate(
        [np.full((4, 1), 0.5), np.full((4, 1), 0.02)] * 3
    ).astype("float32")
    y = np.ones((24, 1), "float32") * 2.0
    converted.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    assert not converted.run_eagerly
    before = {v.path: v.numpy().copy() for v in model.trainable_variables}
    calls.clear()
    history = converted.fit(x, y, batch_size=4, epochs=4, verbose=0, shuffle=False)
    # fit ran as a tf.function (graph mode), where a Python `if` on a tensor
    # only works through AutoGraph: `call`'s Python ran only while tracing,
    # not once per step (24 steps), and never eagerly.
    assert calls and not any(calls), calls
    assert len(calls) < 6, calls
    losses = history.history["loss"]
    assert losses[-1] < losses[0], losses
    for variable in model.trainable_variables:
        assert not np.array_equal(variable.numpy(), before[variable.path]), variable.path
    return losses


calls = []  # tf.executing_eagerly() at each Python run of RecordingDynamic.call


class RecordingDynamic(zoo.DynamicBranchModel):
    def call(self, inputs):
        calls.append(tf.executing_eagerly())
        return super().call(inputs)


def test_dynamic_branch_model_trains_in_graph_mode():
    model, x = RecordingDynamic(), np.full((4, 1), 0.2, "float32")
    converted = kip.convert_to_functional(model, x)
    _fit_dynamic(converted, model)
    # Shared variables: the original agrees after training on both branches.
    for value in (0.5, 0.02):
        other = np.full((4, 1), value, "float32")
        assert_close(converted(other), model(other), f"after fit, x={value}")


class DynamicBlock(keras.layers.Layer):
    """A custom layer with a Python `if` on a tensor value."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(1)

    def call(self, inputs):
        if keras.ops.mean(inputs) > 0.1:
            return self.dense(inputs)
        return self.dense(inputs) * 3.0


class HostModel(keras.Model):
    """A plain model around a dynamic custom layer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_layer = keras.layers.Dense(2)
        self.dynamic = DynamicBlock(name="dynamic_block")

    def call(self, inputs):
        return self.dynamic(self.dense_layer(inputs))


def test_dynamic_sub_layer_converts_and_trains_in_graph_mode():
    """Conversion never fails because part of a model is dynamic: only the
    dynamic layer becomes an opaque node (the rest is traced, so passes can
    reach it), the report names it, and `fit` runs it in graph mode."""
    model = HostModel()
    x = np.full((4, 1), 0.5, "float32")
    converted = kip.convert_to_functional(model, x)
    assert list(converted.kip_report.opaque) == ["dynamic"]  # its attribute
    assert "Python `bool`" in converted.kip_report.opaque["dynamic"]
    dense, dynamic = converted.kip_graph.nodes
    assert dense.operation is model.dense_layer and dense.opaque_reason is None
    assert isinstance(dynamic.operation, kip.OpaqueLayer)
    assert dynamic.operation.layer is model.dynamic and dynamic.name == "dynamic"
    for value in (0.5, -0.5):
        assert_equivalent(model, converted, np.full((4, 1), value, "float32"))
    snapshot_attributes = {id(l): set(vars(l)) for l in all_layers(model)}
    converted.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    data = np.concatenate([np.full((4, 1), 0.5), np.full((4, 1), -0.5)] * 2)
    before = [v.numpy().copy() for v in model.trainable_variables]
    history = converted.fit(data.astype("float32"), np.ones((16, 1), "float32"),
                            batch_size=4, epochs=3, verbose=0, shuffle=False)
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert all(not np.array_equal(v.numpy(), b)
               for v, b in zip(model.trainable_variables, before))
    # Running in graph mode left no attribute (no rebound `call`) behind.
    assert {id(l): set(vars(l)) for l in all_layers(model)} == snapshot_attributes
    assert all("call" not in vars(l) for l in all_layers(model))


class TwoBranchBlock(keras.layers.Layer):
    """A Python `if` on a tensor value picks one of two sub-layers."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positive = keras.layers.Dense(2, name="positive")
        self.negative = keras.layers.Dense(2, name="negative")

    def call(self, inputs):
        if keras.ops.mean(inputs) > 0.0:
            return self.positive(inputs)
        return self.negative(inputs)


class TwoBranchHost(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Dense(3)
        self.branchy = TwoBranchBlock(name="branchy")
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.stem(self.branchy(inputs)))


def test_dynamic_sub_layer_has_both_branches_built_and_the_rest_traced():
    model = TwoBranchHost()
    x = np.ones((4, 2), "float32")
    converted = kip.convert_to_functional(model, x)  # never called before
    assert [node.name for node in converted.kip_graph.nodes] == ["branchy", "stem", "head"]
    assert list(converted.kip_report.opaque) == ["branchy"]
    # `negative` was not called by the first batch, yet exists and is shared.
    assert model.branchy.negative.built
    shared = {id(v) for v in converted.trainable_variables}
    assert all(id(v) in shared for v in model.branchy.negative.trainable_variables)
    # The traced layers around the opaque one take passes.
    passed = kip.apply_passes(converted, [kip.passes.Recompute([model.stem.name])])
    for sign in (1.0, -1.0):
        model.branchy.negative.set_weights(
            [w + 0.5 for w in model.branchy.negative.get_weights()])
        sample = np.full((4, 2), sign, "float32")
        assert_equivalent(model, passed, sample)


# -- frozen BatchNormalization -----------------------------------------------------
def test_frozen_batch_normalization_stays_frozen_in_fit():
    model, x = zoo.make_frozen_bn()
    converted = kip.convert_to_functional(model, x)
    bn = model.frozen_bn
    assert converted.kip_graph.node("frozen_bn").training is False
    assert converted.kip_pinned_training == {bn.name: False}  # by Keras name
    assert converted.kip_graph.node("dropout").training == FOLLOW
    mean, variance = bn.moving_mean.numpy().copy(), bn.moving_variance.numpy().copy()
    gamma, kernel = bn.gamma.numpy().copy(), model.dense.kernel.numpy().copy()

    converted.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    converted.fit(x, np.ones((8, 1), "float32"), batch_size=4, epochs=3, verbose=0)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), mean)
    np.testing.assert_array_equal(bn.moving_variance.numpy(), variance)
    # It did train: the frozen BN's scale and the other layers moved.
    assert not np.array_equal(bn.gamma.numpy(), gamma)
    assert not np.array_equal(model.dense.kernel.numpy(), kernel)
    # And called directly in training mode, the statistics still stay put.
    converted(x, training=True)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), mean)
    assert_equivalent(model, converted, x)


def test_frozen_batch_normalization_behaves_as_in_original_when_training():
    model, x = zoo.make_frozen_bn()
    model.dropout.rate = 0.0  # make training-mode outputs deterministic
    converted = kip.convert_to_functional(model, x)
    assert_close(converted(x, training=True), model(x, training=True), "train mode")


# -- verification ---------------------------------------------------------------
def test_verify_names_the_mismatching_output():
    model, x = zoo.make_dict_model()
    other, _ = zoo.make_dict_model()
    converted_other = kip.convert_to_functional(other, x)
    with pytest.raises(kip.ConversionError, match=r"output `label`") as info:
        kip.frontend.verify.equivalence.check_equivalent(model, converted_other, zoo.as_tensor(x))
    assert isinstance(info.value, ValueError)


def test_verify_names_a_variable_with_a_missing_gradient():
    model, x = zoo.make_mlp()
    model(x)
    twin, _ = zoo.make_mlp()
    twin(x)
    twin.set_weights(model.get_weights())  # same values, other variables
    converted_twin = kip.convert_to_functional(twin, x)
    kip.frontend.verify.equivalence.check_equivalent(model, converted_twin, tf.constant(x), gradients=False)
    with pytest.raises(kip.ConversionError) as info:
        kip.frontend.verify.equivalence.check_equivalent(model, converted_twin, tf.constant(x))
    message = str(info.value)
    assert f"`{model.trainable_variables[0].path}`" in message
    assert "missing" in message


class Scaled(keras.Model):
    def __init__(self, dense, trick=False, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense
        self.trick = trick

    def call(self, inputs):
        y = self.dense(inputs)
        if self.trick:  # same value, twice the gradient
            return 2.0 * y - keras.ops.stop_gradient(y)
        return y


def test_verify_names_a_variable_whose_gradient_differs():
    dense = keras.layers.Dense(2)
    x = np.random.rand(4, 3).astype("float32")
    plain, tricked = Scaled(dense), Scaled(dense, trick=True)
    converted = kip.convert_to_functional(tricked, x)
    with pytest.raises(kip.ConversionError, match="differs") as info:
        kip.frontend.verify.equivalence.check_equivalent(plain, converted, tf.constant(x))
    assert f"gradient w.r.t. variable `{dense.kernel.path}`" in str(info.value)


class TwoFaced(keras.Model):
    """Computes something else when traced than when run: what verification
    exists to catch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        y = self.dense(inputs)
        if isinstance(inputs, keras.KerasTensor):
            return {"out": y * 2.0}
        return {"out": y}


@pytest.mark.parametrize("built", [False, True])
def test_verify_true_raises_and_leaves_the_model_unchanged(built):
    model = TwoFaced()
    x = np.random.rand(4, 3).astype("float32")
    if built:
        model(x)
    snapshot = Snapshot(model)
    with pytest.raises(kip.ConversionError, match=r"output `out`"):
        kip.convert_to_functional(model, x, verify=True)
    snapshot.assert_unchanged()
    converted = kip.convert_to_functional(model, x, verify=False)
    assert not np.allclose(converted(x)["out"], model(x)["out"])


# -- bad input --------------------------------------------------------------------
def _bad_data_cases():
    x = np.random.RandomState(0).normal(size=(8, 6)).astype("float32")
    slices = tf.data.Dataset.from_tensor_slices
    return {
        "empty_dataset": (slices(x).batch(4).take(0), kip.InputDataError, "empty"),
        "filtered_empty": (
            slices(x).batch(4).filter(lambda b: False), kip.InputDataError, "empty"),
        "unbatched_dataset": (slices(x), kip.InputDataError, "not batched"),
        "unbatched_x_y": (slices((x, x[:, :1])), kip.InputDataError, "not batched"),
        "unbatched_mapped": (
            slices(x).map(lambda a: a + 1.0), kip.InputDataError, "not batched"),
        "unbatch_of_batched": (
            slices(x).batch(4).unbatch(), kip.InputDataError, "not batched"),
        "generator": ((row for row in [x]), kip.InputTypeError, "generator"),
        "iterator": (iter([x]), kip.InputTypeError, "first batch"),
        "wrong_width": (x[:, :2], kip.InputDataError, "rejected the first batch"),
        "dict_for_array_model": (
            {"a": x}, kip.InputDataError, r"rejected the first batch \(a dict with keys 'a'\)"),
        "list_of_three": ([x, x, x], kip.InputDataError, "rejected the first batch"),
        "tuple_of_four": ((x, x, x, x), kip.InputDataError, "tuple of 4"),
        "scalar": (np.float32(1.0), kip.InputDataError, "scalar"),
        "string": ("x", kip.InputTypeError, "Input `x` is a str"),
        "none": (None, kip.InputTypeError, "NoneType"),
    }


@pytest.mark.parametrize(
    "case, built",
    [
        (case, built)
        for case in sorted(_bad_data_cases())
        for built in (True, False)
        # An unbuilt model takes any width: that batch is its first.
        if not (case == "wrong_width" and not built)
    ],
)
def test_bad_data_raises_and_leaves_the_model_unchanged(case, built):
    data, error, message = _bad_data_cases()[case]
    model, x = zoo.make_mlp()
    if built:
        model(x)
    snapshot = Snapshot(model)
    with pytest.raises(error, match=message) as info:
        kip.convert_to_functional(model, data)
    assert isinstance(info.value, (ValueError, TypeError))
    snapshot.assert_unchanged()
    # Nothing half-built stays behind: good data converts afterwards.
    converted = kip.convert_to_functional(model, x)
    assert_equivalent(model, converted, x)


def test_generator_is_not_read():
    _, x = zoo.make_mlp()
    model, _ = zoo.make_mlp()
    generator = (batch for batch in [x, x * 2])
    with pytest.raises(kip.InputTypeError, match="generator"):
        kip.convert_to_functional(model, generator)
    np.testing.assert_array_equal(next(generator), x)


@pytest.mark.parametrize("built", [True, False], ids=["built", "unbuilt"])
def test_data_whose_structure_call_rejects(built):
    model, x = zoo.make_dict_model()
    if built:
        model(x)
    snapshot = Snapshot(model)
    with pytest.raises(kip.InputDataError, match=rf"`{model.name}.call` rejected"):
        kip.convert_to_functional(model, x["features"])
    snapshot.assert_unchanged()
    with pytest.raises(kip.InputDataError, match="keys 'features'"):
        kip.convert_to_functional(model, {"features": x["features"]})
    snapshot.assert_unchanged()
    converted = kip.convert_to_functional(model, x)
    assert_equivalent(model, converted, x)


@pytest.mark.parametrize(
    "not_a_model",
    [keras.layers.Dense(3), lambda x: x, tf.Module(), None, zoo.MLP],
    ids=["layer", "function", "tf_module", "none", "model_class"],
)
def test_not_a_keras_model(not_a_model):
    x = np.zeros((4, 6), "float32")
    with pytest.raises(kip.InputTypeError, match="Expected a keras.Model") as info:
        kip.convert_to_functional(not_a_model, x)
    assert isinstance(info.value, TypeError)
    assert type(not_a_model).__name__ in str(info.value)


class _TakesDictOrList(keras.Model):
    """Uses one input of a dict or list: the others may be anything."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        if isinstance(x, dict):
            x = x["dense"]
        elif isinstance(x, (list, tuple)):
            x = x[0]
        return self.dense(x)


def _ragged():
    return tf.ragged.constant([[1.0, 2.0, 3.0], [4.0]])


def _sparse():
    return tf.sparse.from_dense(np.eye(2, 3).astype("float32"))


@pytest.mark.parametrize("make, kind, where", [
    (lambda: _ragged(), "RaggedTensor", "x"),
    (lambda: {"dense": np.zeros((2, 3), "float32"), "ids": _ragged()}, "RaggedTensor", "x['ids']"),
    (lambda: [np.zeros((2, 3), "float32"), _ragged()], "RaggedTensor", "x[1]"),
    (lambda: (_ragged(), np.zeros((2, 2), "float32")), "RaggedTensor", "x"),
    (lambda: tf.data.Dataset.from_tensor_slices(_ragged()).batch(2), "RaggedTensor", "x"),
    (lambda: _sparse(), "SparseTensor", "x"),
    (lambda: {"dense": np.zeros((2, 3), "float32"), "ids": _sparse()}, "SparseTensor", "x['ids']"),
], ids=["ragged", "ragged_dict", "ragged_list", "ragged_xy", "ragged_dataset", "sparse",
        "sparse_dict"])
def test_ragged_and_sparse_inputs_are_refused_naming_the_input(make, kind, where):
    # Before: "TypeError: object of type 'RaggedTensor' has no len()" from
    # deep inside, or TensorFlow's "unsupported type" for a SparseTensor.
    model = _TakesDictOrList()
    with pytest.raises(kip.InputTypeError) as raised:
        kip.convert_to_functional(model, make())
    message = str(raised.value)
    assert message.startswith(f"Input {where} is a tf.{kind}: ragged and sparse inputs are "
                              "not supported"), message


@pytest.mark.parametrize("entry", ["model", "callback"])
def test_ragged_inputs_to_fit_are_refused_naming_the_input(entry):
    data = tf.data.Dataset.from_tensor_slices(
        ({"dense": np.zeros((2, 3), "float32"), "ids": _ragged()}, np.zeros((2, 2), "float32"))
    ).batch(2)
    model = _TakesDictOrList()
    callbacks = []
    if entry == "model":
        model = kip.PluginModel(model)
    else:
        callbacks = [kip.PluginCallback()]
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(kip.InputTypeError, match=r"Input x\['ids'\] is a tf.RaggedTensor"):
        model.fit(data, epochs=1, verbose=0, callbacks=callbacks)


def test_not_a_model_layer_is_left_alone():
    layer = keras.layers.Dense(3)
    layer(np.zeros((2, 6), "float32"))
    snapshot = Snapshot(layer)
    with pytest.raises(kip.InputTypeError, match="got Dense"):
        kip.convert_to_functional(layer, np.zeros((4, 6), "float32"))
    snapshot.assert_unchanged()


def test_successful_conversion_rebinds_nothing():
    model, x = zoo.make_cnn()
    model(x)
    weights = [w.numpy().copy() for w in model.weights]
    kip.convert_to_functional(model, x)
    for layer in all_layers(model):
        assert "call" not in vars(layer)
    for before, after in zip(weights, model.weights):
        np.testing.assert_array_equal(after.numpy(), before)


def test_dynamic_model_trains_under_mirrored(mirrored):
    """MirroredStrategy traces each replica's step in its own thread: the
    opaque node's graph-mode call must work there too, and leave nothing on
    the user's layers."""
    with mirrored.scope():
        model = HostModel()
        converted = kip.convert_to_functional(model, np.full((4, 1), 0.5, "float32"))
        converted.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    data = np.concatenate([np.full((4, 1), 0.5), np.full((4, 1), -0.5)] * 2)
    before = [v.numpy().copy() for v in model.trainable_variables]
    converted.fit(data.astype("float32"), np.ones((16, 1), "float32"),
                  batch_size=8, epochs=2, verbose=0, shuffle=False)
    assert all(not np.array_equal(v.numpy(), b)
               for v, b in zip(model.trainable_variables, before))
    assert all("call" not in vars(l) for l in all_layers(model))


# -- inline tracing through views -------------------------------------------------
def _attribute_identities(model):
    return {
        (id(layer), layer.name, name): id(value)
        for layer in all_layers(model)
        for name, value in vars(layer).items()
    }


def test_tracing_through_views_leaves_every_layer_attribute_as_it_was():
    model, x = zoo.make_nested()
    model(x)
    before = _attribute_identities(model)
    converted = kip.apply_passes(kip.convert_to_functional(model, x), [kip.passes.Expand()])
    after = _attribute_identities(model)
    assert after == before, sorted(
        key[1:] for key in set(before) | set(after) if before.get(key) != after.get(key))
    # the graph names the user's layers, never a view of them
    user_layers = {id(layer) for layer in all_layers(model)}
    for node in converted.kip_graph.nodes:
        operation = getattr(node.operation, "layer", node.operation)  # through an alias
        if isinstance(operation, keras.layers.Layer):  # not a `keras.ops` call
            assert id(operation) in user_layers, node.name
    assert_equivalent(model, converted, x)


class TensorFlowOpsBlock(keras.layers.Layer):
    """`call` uses a TensorFlow op that is not recorded as a graph operation,
    a random one (tests/frontend/test_tracing_idioms.py shows those that are)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)

    def call(self, x):
        h = self.dense(x)
        return h + tf.random.stateless_uniform(tf.shape(h), seed=(1, 2))


class WithTensorFlowOpsBlock(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = TensorFlowOpsBlock(name="tf_block")
        self.head = keras.layers.Dense(1)

    def call(self, x):
        return self.head(self.block(x))


def test_block_that_only_runs_on_real_tensors_is_still_one_node():
    # The inline trace fails on `tf.random.stateless_uniform`; Keras's own
    # output-shape trace (a scratch TF graph) still gives the block's shape.
    model = WithTensorFlowOpsBlock()
    x = np.random.rand(4, 3).astype("float32")
    model(x)
    converted = kip.convert_to_functional(model, x)
    operations = [node.operation for node in converted.kip_graph.nodes]
    assert operations[0] is model.block and operations[1] is model.head and len(operations) == 2
    assert_equivalent(model, converted, x)
