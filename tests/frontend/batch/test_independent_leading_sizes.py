"""Sizes given as graph tensors, and inputs whose leading sizes differ
(keras.io's graph attention network):

- a `keras.ops` call given a graph tensor where Keras takes a Python size
  (`ops.segment_sum(..., num_segments=ops.max(ids) + 1)`, `ops.repeat(x,
  counts)`, `ops.one_hot(ids, n)`, `ops.bincount(ids, minlength=n)`,
  `ops.segment_max`, `ops.top_k(x, k)`) is a `TensorSizedOperation` node
  that calls Keras's own operation with the tensor when the graph runs;
- inputs whose leading dimensions are independent of each other (a set's
  items and its queries; node features and an edge list) are traced,
  generalised and replayed at sizes of their own: a size the call reads
  (`ops.shape(items)[0]`) is read from that input, never from the first
  one, and where one operation holds two inputs' sizes the layer stays
  whole with the reason;
- inputs the call adds row by row are one batch, as before.
"""

import numpy as np
import pytest

import keras
from keras import layers
from keras import ops

import keras_ipu_plugin as kip
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.keras_ops.tensor_sized import TensorSizedOperation
from keras_ipu_plugin.passes import Expand

from graph_checks import assert_equivalent  # tests/ is on sys.path
from models import BlockBetweenDense as Net  # tests/models.py


def _rand(*shape, seed=0):
    return np.random.RandomState(seed).normal(size=shape).astype("float32")


def _custom_left(model):
    return [node.name for node in model.kip_graph.nodes
            if isinstance(node.operation, kip.OpaqueLayer)
            or (isinstance(node.operation, keras.layers.Layer)
                and not type(node.operation).__module__.startswith(("keras.",
                                                                    "keras_ipu_plugin.")))]


def _expanded(model, x):
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    assert _custom_left(passed) == [], passed.kip_report.opaque
    assert passed.kip_report.opaque == {}, passed.kip_report.opaque
    return passed


def _kinds(model, cls):
    return sorted(type(node.operation.operation).__name__ for node in model.kip_graph.nodes
                  if isinstance(node.operation, cls))


def _assert_equal_on_other_data_and_after_loading(model, passed, others, reloaded_on, tmp_path):
    """`passed` computes as `model` on each of `others` (other sizes than the
    traced ones), and so does `passed` saved and loaded, on `reloaded_on`."""
    for other in others:
        np.testing.assert_allclose(passed(other), model(other), rtol=1e-5, atol=1e-5)
    path = str(tmp_path / "passed.keras")
    passed.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(reloaded_on), model(reloaded_on), rtol=1e-5, atol=1e-5)


# -- sizes given as graph tensors (one input) ---------------------------------------
class PerClassStatistics(layers.Layer):
    """Per-class statistics of a batch, the classes' count known only from
    the data: each row's class is its largest feature."""

    def call(self, x):
        ids = ops.cast(ops.argmax(x, axis=-1), "int32")
        classes = ops.max(ids) + 1
        one_hot = ops.one_hot(ids, classes)  # (batch, classes)
        sizes = ops.take(ops.sum(one_hot, axis=0), ids)
        counts = ops.take(ops.bincount(ids, minlength=classes), ids)
        largest = ops.take(ops.segment_max(x, ids, num_segments=classes), ids, axis=0)
        totals = ops.segment_sum(x, ids, num_segments=classes)
        repeated = ops.repeat(ops.sum(totals, axis=-1), ops.bincount(ids))
        best = ops.top_k(x, k=ops.min(ops.cast(counts, "int32")))[0]
        return (x * sizes[:, None] + largest + ops.cast(counts, x.dtype)[:, None]
                + ops.sum(repeated) + ops.sum(best))


def test_keras_ops_given_a_graph_tensor_for_a_size_expand_to_keras_own_operations(tmp_path):
    x = _rand(8, 4)
    model = Net(PerClassStatistics(name="stats"), name="net")
    passed = _expanded(model, x)
    assert _kinds(passed, TensorSizedOperation) == [
        "Bincount", "OneHot", "Repeat", "SegmentMax", "SegmentSum", "TopK"]
    assert_equivalent(model, passed, x)
    _assert_equal_on_other_data_and_after_loading(
        model, passed, [_rand(rows, 4, seed=rows) for rows in (3, 11)],  # other numbers of classes
        _rand(5, 4, seed=5), tmp_path)


def test_keras_ops_given_python_sizes_are_recorded_as_keras_records_them():
    class Fixed(layers.Layer):
        def call(self, x):
            ids = ops.cast(ops.argmax(x, axis=-1), "int32")
            return x + ops.take(ops.segment_sum(x, ids, num_segments=6), ids, axis=0)

    x = _rand(8, 4)
    model = Net(Fixed(name="fixed"), name="net")
    passed = _expanded(model, x)
    assert _kinds(passed, TensorSizedOperation) == []
    assert "SegmentSum" in {type(node.operation).__name__ for node in passed.kip_graph.nodes}
    assert_equivalent(model, passed, x)


def test_a_tensor_sized_operation_runs_keras_own_operation_with_the_tensor():
    from keras.src.ops.math import SegmentSum  # the operation a trace records

    operation = TensorSizedOperation(SegmentSum(None), ["num_segments"], name="segment_sum")
    data = np.arange(6, dtype="float32").reshape(3, 2)
    ids = np.array([0, 0, 2])
    result = operation(np.int32(4), data, ids)
    np.testing.assert_allclose(result, ops.segment_sum(data, ids, num_segments=4))
    spec = operation.compute_output_spec(keras.KerasTensor((), dtype="int32"),
                                         keras.KerasTensor((None, 2)),
                                         keras.KerasTensor((None,), dtype="int32"))
    assert tuple(spec.shape) == (None, 2)


def _reshape_operation():
    from keras.src.ops.numpy import Reshape  # a keras.ops operation of no size

    return Reshape((2, -1))


@pytest.mark.parametrize("change, match", [
    (lambda config: config.update(operation=keras.saving.serialize_keras_object(
        _reshape_operation())), "operation"),
    (lambda config: config.update(attributes=["sorted"]), "attributes"),
    (lambda config: config.update(attributes=[]), "attributes"),
    (lambda config: config["operation"].update(module="os"), "operation"),
])
def test_a_saved_tensor_sized_operation_names_only_what_the_table_allows(change, match):
    from keras.src.ops.math import SegmentSum

    config = TensorSizedOperation(SegmentSum(None), ["num_segments"], name="s").get_config()
    TensorSizedOperation.from_config(config)  # as saved: loads
    change(config)
    with pytest.raises(LoadError, match=match):
        TensorSizedOperation.from_config(config)


def test_keras_is_unchanged_outside_a_trace():
    ids = ops.convert_to_tensor(np.array([0, 1, 1]))
    with pytest.raises(Exception, match="shape"):
        ops.segment_sum(keras.KerasTensor((3,)), ids,
                        num_segments=keras.KerasTensor((), dtype="int32"))


# -- inputs with independent leading sizes -------------------------------------------
class QueryPool(layers.Layer):
    """Set pooling (a set's items, which query each belongs to, and the
    queries, as in a point cloud's or a graph's readout): the queries come
    first, so one shared batch would read the items' size from them."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.keys = layers.Dense(3, name="keys")

    def call(self, inputs):
        queries, items, owner = inputs
        keys = self.keys(items)
        paired = ops.concatenate([ops.take(queries, owner, axis=0), keys], axis=-1)
        flat = ops.reshape(paired, (ops.shape(items)[0], -1))
        pooled = ops.segment_sum(flat, owner, num_segments=ops.shape(queries)[0])
        return ops.concatenate([queries, pooled], axis=-1)


class PoolNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.pool = QueryPool(name="pool")
        self.head = layers.Dense(2, name="head")

    def call(self, inputs):
        return self.head(self.pool(inputs))


def _sets(queries, items, seed=0):
    rng = np.random.RandomState(seed)
    owner = np.sort(rng.randint(0, queries, size=items)).astype("int32")
    owner[-1] = queries - 2  # the last query owns no item
    return [_rand(queries, 3, seed=seed), _rand(items, 3, seed=seed + 1), owner]


def test_inputs_with_independent_leading_sizes_each_give_their_own_size(tmp_path):
    x = _sets(4, 10)
    model = PoolNet(name="pool_net")
    passed = _expanded(model, x)
    assert _kinds(passed, BatchSizedOperation) == ["Reshape", "SegmentSum"]
    inputs = [value for value in keras.tree.flatten(passed.kip_graph.input_values)]
    reshape = next(node for node in passed.kip_graph.nodes
                   if isinstance(node.operation, BatchSizedOperation)
                   and type(node.operation.operation).__name__ == "Reshape")
    assert reshape.args[0] is inputs[1]  # the items', not the queries'
    assert_equivalent(model, passed, x)
    _assert_equal_on_other_data_and_after_loading(
        model, passed,
        [_sets(queries, items, seed=queries + items) for queries, items in ((3, 7), (6, 5), (2, 13))],
        _sets(5, 9, seed=3), tmp_path)


def test_inputs_with_independent_leading_sizes_train_through_plugin_model():
    x = _sets(4, 10)
    y = np.random.RandomState(2).normal(size=(4, 2)).astype("float32")

    def fitted(plugin):
        keras.utils.set_random_seed(0)
        model = PoolNet(name="pool_net")
        model(x)
        if plugin:
            model = kip.PluginModel(model, passes=[Expand("all")])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        history = model.fit(tf_dataset(x, y), epochs=3, verbose=0)
        return history.history["loss"]

    def tf_dataset(x, y):
        import tensorflow as tf
        return tf.data.Dataset.from_tensors((tuple(x), y))

    np.testing.assert_allclose(fitted(True), fitted(False), rtol=1e-5)


class OuterProduct(layers.Layer):
    """A tensor sized by two inputs' leading sizes at once: no one input
    gives both, so the layer stays whole, saying why."""

    def call(self, inputs):
        a, b = inputs
        grid = ops.ones((ops.shape(a)[0], ops.shape(b)[0]))
        return ops.matmul(grid, b) + ops.sum(a)


class PairNet(keras.Model):
    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.block = block
        self.head = layers.Dense(2, name="head")

    def call(self, inputs):
        return self.head(self.block(inputs))


def test_an_operation_holding_two_inputs_leading_sizes_stays_whole_with_the_reason():
    x = [_rand(3, 4), _rand(5, 4, seed=1)]
    model = PairNet(OuterProduct(name="outer"), name="pair_net")
    model(x)
    converted = kip.convert_to_functional(model, x)
    passed = kip.apply_passes(converted, [Expand("all")])
    reasons = passed.kip_report.opaque
    assert list(reasons) == ["block"], reasons
    assert "leading sizes of 2 inputs" in reasons["block"]
    assert "static_batch=True" in reasons["block"]
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-5, atol=1e-5)


class AddedRowByRow(layers.Layer):
    """Two inputs the call adds row by row, so one batch: a size read from
    the second is the first's too."""

    def call(self, inputs):
        a, b = inputs
        both = a + b
        return ops.reshape(both, (ops.shape(b)[0], -1)) * 2.0


def test_inputs_added_row_by_row_are_one_batch_as_before():
    x = [_rand(3, 2, 2), _rand(3, 2, 2, seed=1)]
    model = PairNet(AddedRowByRow(name="added"), name="pair_net")
    passed = _expanded(model, x)
    assert _kinds(passed, BatchSizedOperation) == ["Reshape"]
    for rows in (1, 6):
        other = [_rand(rows, 2, 2, seed=rows), _rand(rows, 2, 2, seed=rows + 1)]
        np.testing.assert_allclose(passed(other), model(other), rtol=1e-5, atol=1e-5)
