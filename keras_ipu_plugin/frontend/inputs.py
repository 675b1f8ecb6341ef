"""Take the first batch from user data and turn it into Keras input specs.

This is the edge where user data enters: every check on the data happens
here, with errors that say what is wrong.
"""

import collections.abc
import inspect
import re
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import InputDataError
from keras_ipu_plugin.errors import InputTypeError
from keras_ipu_plugin.ir.graph import InputSpec


@dataclass
class FirstBatch:
    """The first batch: `x`, `y`, `sample_weight`, and whether it is one
    replica's share already (from a distributed dataset)."""

    x: object
    y: object = None
    sample_weight: object = None
    per_replica: bool = False


class _PerReplica:
    def __init__(self, element):
        self.element = element


def first_batch(data):
    """Return the `FirstBatch` of `data`.

    Follows Keras's convention: a tuple is `(x,)`, `(x, y)` or
    `(x, y, sample_weight)`; a list or dict is `x` alone. A dataset's first
    element is read from a fresh iterator, so what a later `fit` sees is
    unchanged.

    Example:
        ```python
        first_batch((np.zeros((4, 3)), np.ones((4, 1)))).x.shape
        # -> (4, 3)
        ```
    """
    element = _first_element(data)
    per_replica = isinstance(element, _PerReplica)
    if per_replica:
        element = element.element
    if isinstance(element, tuple):
        if not 1 <= len(element) <= 3:
            raise InputDataError(
                f"A tuple batch must be (x,), (x, y) or (x, y, sample_weight); "
                f"got a tuple of {len(element)} elements. Pass several model "
                "inputs as a list or a dict."
            )
        element = element + (None,) * (3 - len(element))
        x, y, sample_weight = element
    else:
        x, y, sample_weight = element, None, None
    _check_leaves(x)
    return FirstBatch(x, y, sample_weight, per_replica)


def _first_element(data):
    if isinstance(data, tf.data.Dataset):
        return _first_dataset_element(data)
    if isinstance(data, tf.distribute.DistributedDataset):
        return _first_distributed_element(data)
    if isinstance(data, keras.utils.PyDataset):
        if data.num_batches == 0:
            raise InputDataError("The PyDataset is empty: it has no batch.")
        return _as_tuple_if_list_of_xy(data[0])
    if inspect.isgenerator(data) or isinstance(data, collections.abc.Iterator):
        raise InputTypeError(
            f"Cannot take the first batch from a {type(data).__name__}: reading "
            "it would consume that batch before `fit` sees it, and its length "
            "is unknown. Pass a tf.data.Dataset (e.g. "
            "tf.data.Dataset.from_generator(...)), a keras.utils.PyDataset, or "
            "the first batch itself."
        )
    return data


def _as_tuple_if_list_of_xy(element):
    return tuple(element) if isinstance(element, list) else element


def _first_dataset_element(dataset):
    batched = _compat.dataset_is_batched(dataset)
    if batched is False:
        raise InputDataError(
            "The dataset is not batched: call `.batch(batch_size)` on it "
            "before converting (the first element must be a whole batch)."
        )
    # A dataset drawing its order from seeds (a reshuffling shuffle) is
    # read through a copy with seeds of its own: read itself, its next
    # iteration (`fit`'s) would see another order.
    try:
        source = dataset_to_peek(dataset)
    except DatasetStateError as error:
        raise InputDataError(
            f"Cannot read the dataset's first batch without changing what a later `fit` "
            f"sees: {error}. Give the first batch itself (`convert_to_functional(model, "
            "x_batch)`, or `plugin_model.convert(x_batch)` before `fit`), train with "
            "`kip.PluginCallback` (it converts from the batch `fit` reads), or draw in the "
            "pipeline from stateless sources (`tf.random.stateless_uniform`, a seeded "
            "`shuffle`).") from None
    for element in without_autotuning(source.take(1)):
        if batched is None:
            _check_batch_rank(element)
        return element
    raise InputDataError("The dataset is empty: it has no first batch.")


def without_autotuning(dataset):
    """`dataset` with tf.data's autotuning off, for a peek at one batch.

    An autotuned iterator runs a tuning thread from its first element; when
    the iterator is deleted, TensorFlow (to at least 2.21) can wait for that
    thread's current sleep to end, which grows to a minute as the iterator
    ages. A one-batch peek gains nothing from tuning, so it has no thread to
    wait for. The elements are the same.

    Example:
        ```python
        peek = without_autotuning(tf.data.Dataset.range(4).batch(2).take(1))
        peek.options().autotune.enabled
        # -> False
        ```
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _first_distributed_element(dataset):
    # The dataset's own strategy: the caller may be outside its scope, where
    # the current (default) strategy cannot unwrap its per-replica values.
    strategy = _compat.dataset_strategy(dataset) or tf.distribute.get_strategy()
    for element in dataset:
        local = tf.nest.map_structure(
            lambda v: strategy.experimental_local_results(v)[0], element
        )
        return _PerReplica(local)
    raise InputDataError("The distributed dataset is empty.")


def _check_batch_rank(element):
    x = element[0] if isinstance(element, tuple) else element
    for leaf in tf.nest.flatten(x):
        if len(getattr(leaf, "shape", ())) == 0:
            raise InputDataError(
                "The dataset yields scalars, so it is not batched: call "
                "`.batch(batch_size)` on it before converting."
            )


def check_dense(x):
    """Raise `InputTypeError` naming the first ragged or sparse input of `x`.

    A composite tensor has no dense shape to make an input spec of, nor rows
    to verify on; unchecked it fails deep inside ("object of type
    'RaggedTensor' has no len()").

    Example:
        ```python
        check_dense({"ids": tf.ragged.constant([[1, 2], [3]])})
        ```
        Traceback (most recent call last):
        InputTypeError: Input x['ids'] is a tf.RaggedTensor: ragged and sparse ...
    """
    for path, leaf in keras.tree.flatten_with_path(x):
        if not isinstance(leaf, (tf.RaggedTensor, tf.SparseTensor)):
            continue
        where = "x" + "".join(f"[{p!r}]" for p in path)
        if isinstance(leaf, tf.RaggedTensor):
            remedy = ("give it dense and padded (`.to_tensor()`, or padded_batch on a "
                      "dataset; a mask or a Masking layer can mark the padding)")
        else:
            remedy = "give it dense (`tf.sparse.to_dense`, e.g. in dataset.map)"
        raise InputTypeError(
            f"Input {where} is a tf.{type(leaf).__name__}: ragged and sparse inputs "
            f"are not supported; {remedy}."
        )


def _check_leaves(x):
    leaves = tf.nest.flatten(x)
    if not leaves:
        raise InputDataError("The first batch `x` holds no tensor.")
    check_dense(x)
    for path, leaf in keras.tree.flatten_with_path(x):
        if not isinstance(leaf, (np.ndarray, tf.Tensor, tf.Variable)) and not (
            hasattr(leaf, "shape") and hasattr(leaf, "dtype")
        ):
            where = ".".join(str(p) for p in path) or "x"
            raise InputTypeError(
                f"Input `{where}` is a {type(leaf).__name__}; expected a numpy "
                "array or a tensor."
            )
        if len(leaf.shape) == 0:
            where = ".".join(str(p) for p in path) or "x"
            raise InputDataError(
                f"Input `{where}` is a scalar; a batch needs a leading batch "
                "dimension."
            )


def input_specs(x, *, static_batch=False, strategy=None, already_per_replica=False):
    """Input specs with the structure of `x` (a dict keeps its keys as names).

    With `static_batch=True` the batch dimension is the per-replica batch of
    `strategy` (the current one when None): the global batch divided by the
    number of replicas, which must divide it.
    """
    strategy = strategy or tf.distribute.get_strategy()
    replicas = 1 if already_per_replica else strategy.num_replicas_in_sync

    def spec(path, leaf):
        name = input_name(path)
        batch = None
        if static_batch:
            batch = _per_replica_batch(name, int(leaf.shape[0]), replicas)
        return InputSpec(
            name=name,
            shape=tuple(None if d is None else int(d) for d in leaf.shape[1:]),
            dtype=_keras_dtype(leaf.dtype),
            batch_size=batch,
        )

    specs = [spec(path, leaf) for path, leaf in keras.tree.flatten_with_path(x)]
    return keras.tree.pack_sequence_as(x, specs)


def batch_size_of(x):
    return int(tf.nest.flatten(x)[0].shape[0])


def _per_replica_batch(name, global_batch, replicas):
    if global_batch % replicas:
        raise InputDataError(
            f"Input `{name}`: the global batch of {global_batch} is not "
            f"divisible by the {replicas} replicas of the active strategy, so "
            "there is no static per-replica batch. Use a batch size that is a "
            "multiple of the replica count, or static_batch=False."
        )
    return global_batch // replicas


def input_name(path):
    """The name of the input at `path` in `x`: dict keys name inputs;
    positions in a list or tuple give `input_<i>`."""
    if not path:
        return "input"
    name = "_".join(str(p) for p in path)
    return name if isinstance(path[0], str) else f"input_{name}"


def _keras_dtype(dtype):
    name = tf.as_dtype(dtype).name
    # Keras casts float64 data to floatx in fit; keep the converted model's
    # inputs in the dtype the model really computes in.
    if name == "float64":
        return keras.config.floatx()
    return name


# Dataset operations that draw their seeds from a seed generator resource
# each time an iterator is made (a reshuffling `shuffle`, `Dataset.random`):
# {op: (index of seed, of seed2, of the generator input; the attribute that
# says whether each iteration draws anew)}.
_SEEDED_DATASET_OPS = {
    "ShuffleDatasetV3": (2, 3, 4, "reshuffle_each_iteration"),
    "ShuffleAndRepeatDatasetV2": (2, 3, 5, "reshuffle_each_iteration"),
    "RandomDatasetV2": (0, 1, 2, "rerandomize_each_iteration"),
}

# Stateful ops a dataset's functions may run whose state does not outlive
# an iteration, or that only read: each iterator instantiates the functions
# anew (a seeded `tf.random.uniform` in `map` gives the same numbers every
# epoch), a lookup table or variable read changes nothing, and a Python
# function (`from_generator`, `py_function`) is called again from the start
# (from_generator starts its generator anew for each iterator).
_PER_ITERATION_STATEFUL_OPS = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomShuffle", "Multinomial", "RandomGamma",
    "RandomPoisson", "RandomPoissonV2",
    "ReadVariableOp", "VarHandleOp", "LookupTableFindV2", "LookupTableSizeV2",
    "LookupTableExportV2", "HashTableV2", "LookupTableImportV2",
    "InitializeTableV2", "InitializeTableFromTextFileV2",
    "Assert", "Print", "PrintV2",
    "PyFunc", "PyFuncStateless", "EagerPyFunc",
    "_Arg", "_Retval",
})
_DATASET_OP = re.compile(r"(Dataset|DatasetV\d+)$")


class DatasetStateError(ValueError):
    """Reading a dataset's first element would change what its next
    iteration gives, and no copy of it avoids that."""


def dataset_to_peek(dataset):
    """The dataset to read `dataset`'s first element from such that what a
    later iteration of `dataset` gives is unchanged: `dataset` itself, or a
    copy of its pipeline whose seed generators are its own. Raises
    `DatasetStateError` naming the ops where neither is possible.

    A reshuffling `shuffle(seed=...)` draws the order of each iteration from
    a generator that the dataset object holds: one element read from a
    fresh iterator moves it on, so the next `fit` would see the order of
    the second iteration, not the first. The copy is the same pipeline
    (serialized and rebuilt) with a fresh generator of the same seeds: its
    first iteration gives the first order, and the user's dataset still
    gives it too. A function in the pipeline that writes state living
    outside the iterator (a `tf.random.Generator`, a variable it assigns)
    would move that state from the copy too: that is the error.

    Example:
        ```python
        ds = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(4)
        copy = dataset_to_peek(ds)
        next(iter(copy)).numpy().tolist() == next(iter(ds)).numpy().tolist()
        # -> True
        ```
    """
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # IGNORE: a generator's function is called anew
            strip_device_assignment=True)
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except (tf.errors.OpError, ValueError, TypeError) as error:
        raise DatasetStateError(
            "its pipeline cannot be inspected for state that reading an element would "
            f"move ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None
    writes = sorted(op for op in _compat.stateful_op_names(graph)
                    if op not in _PER_ITERATION_STATEFUL_OPS and not _DATASET_OP.search(op))
    if writes:
        raise DatasetStateError(
            f"a function in its pipeline runs {', '.join(f'`{op}`' for op in writes)}, "
            "which changes state outside the dataset (a `tf.random.Generator`, a variable "
            "it assigns), so reading an element would change what the next iteration gives")
    seeded = [node for node in graph.node if node.op in _SEEDED_DATASET_OPS]
    if not seeded:
        return dataset
    for node in seeded:
        seed, seed2, generator, attribute = _SEEDED_DATASET_OPS[node.op]
        if len(node.input) <= generator:
            raise DatasetStateError(f"its `{node.op}` has no seed generator input to copy")
        redraw = graph.node.add()
        redraw.name = f"{node.name}/kip_redraw"
        redraw.op = "Const"
        redraw.attr["dtype"].type = tf.bool.as_datatype_enum
        redraw.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(node.attr[attribute].b))
        fresh = graph.node.add()
        fresh.name = f"{node.name}/kip_seed_generator"
        fresh.op = "AnonymousSeedGenerator"
        fresh.input.extend([node.input[seed], node.input[seed2], redraw.name])
        node.input[generator] = f"{fresh.name}:0"
    try:
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
        return tf.data.experimental.from_variant(variant, dataset.element_spec)
    except (tf.errors.OpError, ValueError, TypeError) as error:
        raise DatasetStateError(
            "its pipeline draws from seed generators and cannot be rebuilt with seed "
            f"generators of its own ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:200]})") from None
