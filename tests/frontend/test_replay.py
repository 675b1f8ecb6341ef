"""Each kind of block is traced once and replayed over the others
(`frontend/replay.py`), and blocks that differ are never replayed from
each other."""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.frontend.replay import layer_signature
from keras_ipu_plugin.passes import Expand

layers = keras.layers


class CountingBlock(layers.Layer):
    calls = 0

    def __init__(self, width=4, twice=False, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.twice = twice
        self.dense = layers.Dense(width, activation=activation)
        self.norm = layers.LayerNormalization()
        self.add = layers.Add()

    def call(self, x):
        CountingBlock.calls += 1
        h = self.norm(self.dense(x))
        if self.twice:  # Python control flow on a plain attribute
            h = self.norm(self.dense(h))
        return self.add([x, h])


class Stack(keras.Model):
    def __init__(self, blocks, **kwargs):
        super().__init__(**kwargs)
        self.blocks = blocks

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _built(blocks):
    x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
    model = Stack(blocks)
    model(x)
    return model, x


def test_expand_traces_each_kind_of_block_once():
    model, x = _built([CountingBlock(name=f"block_{i}") for i in range(6)])
    CountingBlock.calls = 0
    converted = kip.convert_to_functional(model, x, verify=False)
    at_conversion = CountingBlock.calls
    passed = kip.apply_passes(converted, [Expand()], verify=False)
    at_expansion = CountingBlock.calls - at_conversion
    # Once per kind (per training mode traced), not once per block.
    assert at_conversion <= 2 and at_expansion <= 2, (at_conversion, at_expansion)
    # ... and each block's nodes call its own layers.
    for i, block in enumerate(model.blocks):
        assert passed.kip_graph.node(f"blocks.{i}.dense").operation is block.dense
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


def test_blocks_that_differ_are_not_replayed_from_each_other():
    blocks = [CountingBlock(name="plain"), CountingBlock(twice=True, name="twice"),
              CountingBlock(activation="tanh", name="tanh"), CountingBlock(name="plain_2")]
    model, x = _built(blocks)
    signatures = [layer_signature(block) for block in blocks]
    assert signatures[0] == signatures[3]
    assert len({signatures[0], signatures[1], signatures[2]}) == 3
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    names = [node.name for node in passed.kip_graph.nodes]
    # By attribute path: blocks.1 is `twice`, blocks.0 is `plain`.
    assert sum(name.startswith("blocks.1.") for name in names) == 5  # dense, norm twice, add
    assert sum(name.startswith("blocks.0.") for name in names) == 3
    kip.frontend.verify.equivalence.check_equivalent(model, passed, x)


class Table:
    """An object of the user's: what `call` reads of it cannot be compared."""


def test_a_block_holding_an_unknown_object_has_no_signature():
    block = CountingBlock(name="block")
    _built([block])
    block.table = Table()  # not plain data: the trace cannot be told equal
    assert layer_signature(block) is None
    assert layer_signature(CountingBlock(name="unbuilt")) is None


class DenseBlock(layers.Layer):
    """Its Dense's output carries the Keras mask of the block's input (Keras
    sets it on the Dense's output), so the block's output does too."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(6, activation="tanh", name="dense")

    def call(self, x):
        return self.dense(x)


class MaskedMean(layers.Layer):
    """Averages the steps its Keras mask keeps (a custom layer: expanded
    too, its `call` must be handed the mask)."""

    def call(self, x, mask=None):
        if mask is None:
            return keras.ops.mean(x, axis=1)
        weights = keras.ops.expand_dims(keras.ops.cast(mask, x.dtype), -1)
        return keras.ops.sum(x * weights, axis=1) / keras.ops.sum(weights, axis=1)


class MaskedStack(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(20, 6, mask_zero=True)
        self.blocks = [DenseBlock(name=f"block_{i}") for i in range(3)]
        self.pool = MaskedMean(name="mean")

    def call(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.pool(x)


def test_blocks_given_a_keras_mask_keep_it_when_expanded():
    # A replayed block's values carried no Keras mask: the custom mean
    # after the last block, expanded, was handed none and averaged the
    # padding too, a silently different output.
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 7))
    ids[:, 4:] = 0
    model = MaskedStack(name="masked")
    model(ids)
    passed = kip.apply_passes(kip.convert_to_functional(model, ids), [Expand()])
    assert [n.name for n in passed.kip_graph.nodes if n.name.startswith("blocks.")] == [
        "blocks.0.dense", "blocks.1.dense", "blocks.2.dense"]
    np.testing.assert_allclose(passed(ids), model(ids), atol=1e-6)


class ScaleBlock(layers.Layer):
    """A weight of its own (held as an attribute), and a Dense."""

    def __init__(self, size, dtype="float32", **kwargs):
        super().__init__(**kwargs)
        self.scale = self.add_weight(shape=(size,), initializer="ones", dtype=dtype)
        self.dense = layers.Dense(size)

    def call(self, x):
        return self.dense(x) + keras.ops.cast(keras.ops.sum(self.scale), x.dtype)


def test_blocks_whose_weights_differ_in_shape_or_dtype_have_other_signatures():
    # Signatures read the shapes and dtypes Keras stores on its variables
    # (the public properties cost too much per weight); blocks with other
    # weights must still tell apart.
    same, other = ScaleBlock(4), ScaleBlock(4)
    wider, in_float64 = ScaleBlock(5), ScaleBlock(4, dtype="float64")
    narrow_input = ScaleBlock(4)
    for block in (same, other, wider, in_float64):
        block(np.zeros((1, 4), "float32"))
    narrow_input(np.zeros((1, 2), "float32"))  # a kernel of another shape
    signatures = [layer_signature(b) for b in (same, other, wider, in_float64, narrow_input)]
    assert None not in signatures and signatures[0] == signatures[1]
    assert len(set(signatures[1:])) == 4


# -- every kind of block is replayed, exactly as tracing it would expand it ----

import tensorflow as tf  # noqa: E402

from keras_ipu_plugin.frontend.replay import CallTemplates  # noqa: E402
from keras_ipu_plugin.ir.graph import Value  # noqa: E402
from keras_ipu_plugin.ir.graph import map_leaves  # noqa: E402
from keras_ipu_plugin.passes.expand import expand_graph  # noqa: E402
from keras_ipu_plugin.report import Report  # noqa: E402
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation  # noqa: E402
from keras_ipu_plugin.layers.layer_kinds import is_expandable  # noqa: E402
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw  # noqa: E402
from keras_ipu_plugin.layers.state import HeldConstant  # noqa: E402
from keras_ipu_plugin.layers.state import VariableRead  # noqa: E402
from keras_ipu_plugin.layers.tf_calls import TFFunction  # noqa: E402

ops = keras.ops


class TracingOnly(CallTemplates):
    """Never replays: every call is traced (the reference a replay must equal)."""

    def replay(self, node, reads):
        return None


def _expanded(converted, templates):
    graph = converted.kip_graph.copy()
    expand_graph(graph, lambda node: is_expandable(node.operation), Report(), "expand",
                 recursive=True, templates=templates)
    graph.lint()
    return graph


_OPERATION_BOOKKEEPING = {"name", "_inbound_nodes", "_outbound_nodes", "_auto_config",
                          "_auto_config_error_args", "_lock", "_remat_mode"}


def _operation(operation):
    """What a node runs, comparable across two expansions: the model's own
    objects by identity, those an expansion makes by what they hold."""
    if isinstance(operation, VariableRead):
        return ("read", id(operation.variable), operation.dtype_policy.name)
    if isinstance(operation, HeldConstant):
        return ("constant", operation.value.tolist(), str(operation.value.dtype), operation.name)
    if isinstance(operation, RandomDraw):
        seed = operation.seed_generator
        return ("draw", operation.distribution, operation.draw_shape, operation.arguments,
                operation.draw_dtype, id(seed) if isinstance(seed, keras.random.SeedGenerator)
                else seed)
    if isinstance(operation, BatchSizedOperation):
        return ("batch sized", _operation(operation.operation), operation.attributes,
                operation.multiples)
    if isinstance(operation, TFFunction):
        return ("tf", operation.function)
    if isinstance(operation, keras.layers.Layer):
        if type(operation).__module__.startswith("keras_ipu_plugin"):
            return (type(operation).__name__,)
        return ("layer", id(operation))
    return ("op", type(operation), sorted(
        (key, repr(value)) for key, value in vars(operation).items()
        if key not in _OPERATION_BOOKKEEPING))


def _described(graph):
    """The graph as data: each node's name, operation, wiring, training,
    output specs, Keras masks and blocks."""
    where = {}
    for index, value in enumerate(keras.tree.flatten(graph.input_values)):
        where[value] = ("input", index)
    for index, node in enumerate(graph.nodes):
        for output, value in enumerate(node.outputs):
            where[value] = (index, output)

    def leaf(item):
        if isinstance(item, Value):
            return where[item]
        if isinstance(item, (np.ndarray, tf.Tensor)):
            return ("array", np.asarray(item).tolist())
        return item

    rows = [(
        node.name, _operation(node.operation), map_leaves(leaf, node.args),
        map_leaves(leaf, node.kwargs), node.training, node.output_structure,
        [(tuple(v.spec.shape), v.spec.dtype,
          where[v.mask] if isinstance(v.mask, Value) else v.mask) for v in node.outputs],
        [block.path for block in node.from_blocks], node.opaque_reason,
    ) for node in graph.nodes]
    return rows + [map_leaves(leaf, graph.outputs)]


def _check_replay(model, x, traced, replayed):
    """Expand `model` with replay and by tracing every block: the graphs
    must be the same, the calls traced / replayed as many as said, and the
    expanded model must compute what `model` does."""
    converted = kip.convert_to_functional(model, x)
    templates = CallTemplates()
    graph = _expanded(converted, templates)
    assert _described(graph) == _described(_expanded(converted, TracingOnly()))
    assert (templates.traced, templates.replayed) == (traced, replayed)
    passed = kip.apply_passes(converted, [Expand()])  # verified against `converted`
    np.testing.assert_allclose(np.asarray(passed(x)), np.asarray(model(x)), atol=1e-5)
    return graph


class Sequence(keras.Model):
    def __init__(self, blocks, head=None, **kwargs):
        super().__init__(**kwargs)
        self.blocks = blocks
        self.head = head

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


def _built_sequence(blocks, x, head=None):
    model = Sequence(blocks, head)
    model(x)
    return model


X = np.random.default_rng(1).normal(size=(3, 8)).astype("float32")


class OpsResidual(layers.Layer):
    """The residual block as people write it: joined by `x + h`."""

    def __init__(self, width=8, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(width, activation=activation)
        self.n = layers.LayerNormalization()

    def call(self, x):
        return self.n(x + self.d(x))


def test_blocks_joined_by_keras_ops_are_replayed():
    model = _built_sequence([OpsResidual() for _ in range(5)], X)
    graph = _check_replay(model, X, traced=1, replayed=4)
    for i, block in enumerate(model.blocks):
        assert graph.node(f"blocks.{i}.d").operation is block.d
        assert graph.node(f"blocks.{i}.n").operation is block.n
        assert f"blocks.{i}.add" in graph.names
    ops_nodes = [node for node in graph.nodes if not node.is_layer]
    # Each replayed block has an operation of its own, named after its node.
    assert len({id(node.operation) for node in ops_nodes}) == 5
    assert all(node.operation.name == node.name for node in ops_nodes)


class TrainingBlock(layers.Layer):
    """Sub-layers following the model's `training`, and one pinned."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)
        self.drop = layers.Dropout(0.5)
        self.frozen = layers.BatchNormalization()

    def call(self, x, training=None):
        return x + self.frozen(self.drop(self.d(x), training=training), training=False)


def test_blocks_with_training_modes_are_replayed_with_them():
    model = _built_sequence([TrainingBlock() for _ in range(4)], X)
    # Keras leaves the pinned `training=False` in its call context, so the
    # blocks after the first run in inference (the converted graph too):
    # two kinds, one block of the first and three of the second.
    graph = _check_replay(model, X, traced=2, replayed=2)
    assert [graph.node(f"blocks.{i}.{name}").training for i in range(4)
            for name in ("drop", "frozen")] == ["follow", False] + [False, False] * 3


class TFBlock(layers.Layer):
    """A Keras 2 style block: TensorFlow functions on the symbolic tensors."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)

    def call(self, x):
        return tf.nn.relu(self.d(x)) + tf.square(x) * 0.5


def test_blocks_calling_tensorflow_functions_are_replayed():
    model = _built_sequence([TFBlock() for _ in range(4)], X)
    graph = _check_replay(model, X, traced=1, replayed=3)
    assert sum(isinstance(node.operation, TFFunction) for node in graph.nodes) == 8


class ReadingBlock(layers.Layer):
    """Reads weights of its own (a scale, a token broadcast to the batch)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(8,), initializer="random_normal", name="scale")
        self.token = self.add_weight(shape=(1, 8), initializer="random_normal", name="token")

    def call(self, x):
        token = ops.broadcast_to(self.token, (ops.shape(x)[0], 8))
        return self.d(x) * self.scale + token


def test_blocks_reading_their_own_weights_are_replayed_with_their_own_variables():
    model = _built_sequence([ReadingBlock() for _ in range(4)], X)
    graph = _check_replay(model, X, traced=1, replayed=3)
    for i, block in enumerate(model.blocks):
        assert graph.node(f"blocks.{i}.scale").operation.variable is block.scale
        assert graph.node(f"blocks.{i}.token").operation.variable is block.token
    assert sum(isinstance(node.operation, BatchSizedOperation) for node in graph.nodes) == 4


class PositionBlock(layers.Layer):
    """Calls a sub-layer on a constant made in `call` (a held constant)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.positions = layers.Embedding(5, 8)

    def call(self, x):
        return x + self.positions(ops.arange(ops.shape(x)[1]))


def test_blocks_holding_constants_are_replayed():
    x = np.random.default_rng(2).normal(size=(2, 5, 8)).astype("float32")
    model = _built_sequence([PositionBlock() for _ in range(3)], x)
    graph = _check_replay(model, x, traced=1, replayed=2)
    constants = [node for node in graph.nodes if isinstance(node.operation, HeldConstant)]
    assert [node.name for node in constants] == [
        f"blocks.{i}.positions_input" for i in range(3)]
    assert len({id(node.operation) for node in constants}) == 3


class NoisyBlock(layers.Layer):
    """Draws noise from a seed generator of its own, and from a fixed seed."""

    def __init__(self, seed, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)
        self.noise = keras.random.SeedGenerator(seed)

    def call(self, x):
        h = self.d(x) + keras.random.normal((ops.shape(x)[0], 8), seed=self.noise)
        return h * keras.random.uniform((1, 8), minval=0.5, maxval=1.5, seed=7)


def test_random_draws_are_replayed_from_each_blocks_own_seed_generator():
    model = _built_sequence([NoisyBlock(seed) for seed in range(4)], X)
    converted = kip.convert_to_functional(model, X)
    templates = CallTemplates()
    graph = _expanded(converted, templates)
    assert _described(graph) == _described(_expanded(converted, TracingOnly()))
    assert (templates.traced, templates.replayed) == (1, 3)
    draws = [node.operation for node in graph.nodes
             if isinstance(node.operation, RandomDraw) and node.operation.distribution == "normal"]
    assert [draw.seed_generator for draw in draws] == [block.noise for block in model.blocks]
    # The draws are the original's, number for number (apply_passes verifies).
    kip.apply_passes(converted, [Expand()])


class Inner(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)

    def call(self, x):
        return x + ops.tanh(self.d(x))


class Outer(layers.Layer):
    """Blocks inside a block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first, self.second = Inner(), Inner()

    def call(self, x):
        return self.second(self.first(x)) * 0.5


def test_nested_blocks_are_replayed_at_every_level():
    model = _built_sequence([Outer() for _ in range(3)], X)
    graph = _check_replay(model, X, traced=2, replayed=7)  # one Outer, one Inner
    assert graph.node("blocks.2.second.d").operation is model.blocks[2].second.d


class MaskedOps(layers.Layer):
    """An `x + h` block on masked steps: Keras hands its sub-layers the mask."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(6, activation="tanh")
        self.supports_masking = True

    def call(self, x):
        return x + self.d(x)


class MaskedOpsStack(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = layers.Embedding(20, 6, mask_zero=True)
        self.blocks = [MaskedOps() for _ in range(3)]
        self.pool = MaskedMean()

    def call(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.pool(x)


def test_blocks_on_masked_inputs_are_replayed_and_keep_the_masks():
    ids = np.random.default_rng(0).integers(1, 20, size=(4, 7))
    ids[:, 4:] = 0
    model = MaskedOpsStack()
    model(ids)
    _check_replay(model, ids, traced=2, replayed=2)  # the blocks (1 + 2) and the mean


# -- blocks of one class that differ are never replayed from each other --------

class Configured(layers.Layer):
    """Branches in Python on what it was made with."""

    def __init__(self, twice=False, config=None, activation="relu", **kwargs):
        super().__init__(**kwargs)
        self.twice = twice
        self.config = dict(config or {"gate": False})
        self.d = layers.Dense(8, activation=activation)

    def call(self, x):
        h = self.d(x)
        if self.twice:  # a Python attribute
            h = self.d(h)
        if self.config["gate"]:  # a config value
            h = h * ops.sigmoid(h)
        return x + h


@pytest.mark.parametrize("other", [
    {"twice": True}, {"config": {"gate": True}}, {"activation": "tanh"},
], ids=["attribute", "config value", "activation"])
def test_blocks_made_differently_are_traced_apart(other):
    blocks = [Configured(), Configured(**other), Configured(), Configured(**other)]
    model = _built_sequence(blocks, X)
    _check_replay(model, X, traced=2, replayed=2)


class Folding(layers.Layer):
    """No weights: what it computes follows its input's shape."""

    def call(self, x):
        return ops.reshape(x, (-1, x.shape[-1] // 2, 2))[:, :, 0] + 1.0


class Widths(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.wide, self.narrow, self.wide_2 = Folding(), Folding(), Folding()

    def call(self, x):
        return ops.concatenate([self.wide(x), self.wide_2(x), self.narrow(self.wide(x))], -1)


def test_blocks_given_other_shapes_are_traced_apart():
    model = Widths()
    model(X)
    # wide, then wide_2 and wide again replayed; narrow (half as wide) traced.
    graph = _check_replay(model, X, traced=2, replayed=2)
    reshapes = [node.operation for node in graph.nodes if type(node.operation).__name__ == "Reshape"]
    assert sorted(tuple(op.newshape) for op in reshapes) == [(-1, 2, 2)] + [(-1, 4, 2)] * 3


class Tagged(layers.Layer):
    """Reads its own name in `call`: no two of its blocks trace alike."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)

    def call(self, x):
        return x + self.d(x) if self.name.endswith("_odd") else x - self.d(x)


def test_blocks_whose_call_reads_their_name_are_each_traced():
    blocks = [Tagged(name="t_even"), Tagged(name="t_odd"), Tagged(name="t_even_2")]
    model = _built_sequence(blocks, X)
    _check_replay(model, X, traced=3, replayed=0)


class Pair(layers.Layer):
    """Two inputs, and maybe one Dense held twice."""

    def __init__(self, shared=False, **kwargs):
        super().__init__(**kwargs)
        self.first = layers.Dense(8)
        self.second = self.first if shared else layers.Dense(8)

    def call(self, a, b):
        return self.first(a) + self.second(b)


class Triple(layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d = layers.Dense(8)

    def call(self, a, b, c):
        return self.d(a) - b * c


class Pairs(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.same_input, self.two_inputs = Pair(), Pair()
        self.shared, self.unshared = Pair(shared=True), Pair()
        self.aba, self.abb = Triple(), Triple()

    def call(self, x):
        y = x * 2.0
        h = self.same_input(x, x) + self.two_inputs(x, y)  # one input given twice, or two
        h = self.shared(h, y) + self.unshared(h, y)  # one Dense held twice, or two
        return self.aba(h, y, h) + self.abb(h, y, y)  # two inputs, one of them twice


def test_calls_sharing_an_input_or_a_sub_layer_are_traced_apart():
    model = Pairs()
    model(X)
    _check_replay(model, X, traced=5, replayed=1)  # unshared replays two_inputs


def test_a_block_holding_an_array_is_signed_by_its_values():
    a, b, c = CountingBlock(), CountingBlock(), CountingBlock()
    _built([a, b, c])
    a.table, b.table, c.table = np.arange(3.0), np.arange(3.0), np.arange(1.0, 4.0)
    assert layer_signature(a) == layer_signature(b) != layer_signature(c)


class HoldsAnIdentityOfItsPolicy(layers.Layer):
    """keras_hub's DINOv2 layer: `layers.Identity(dtype=self.dtype_policy)`,
    of which Keras has no config (`get_config` raises)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = layers.Dense(4, name="dense")
        self.drop_path = layers.Identity(dtype=self.dtype_policy, name="drop_path")

    def call(self, x):
        return x + self.drop_path(self.dense(x))


def test_a_block_holding_a_layer_keras_has_no_config_of_is_traced_on_its_own():
    model, x = _built([HoldsAnIdentityOfItsPolicy(name=f"block_{i}") for i in range(2)])
    with pytest.raises(NotImplementedError):
        model.blocks[0].drop_path.get_config()
    assert layer_signature(model.blocks[0]) is None
    passed = kip.apply_passes(kip.convert_to_functional(model, x), [Expand()])
    assert {type(n.operation).__name__ for n in passed.kip_graph.nodes if n.is_layer} >= {
        "Dense", "Identity"}
    np.testing.assert_allclose(passed(x), model(x), rtol=1e-6)
