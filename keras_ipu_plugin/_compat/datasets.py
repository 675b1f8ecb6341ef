"""`tf.data` pipelines: whether one is batched, its strategy, its seed generators.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""

import tensorflow as tf


_BATCHING_DATASETS = (
    "_BatchDataset",
    "_ParallelBatchDataset",
    "_PaddedBatchDataset",
    "_RebatchDataset",
    "_LegacyRebatchDataset",
    "_DenseToRaggedDataset",
    "_DenseToSparseBatchDataset",
    "_BucketBySequenceLengthDataset",
    "_UnbatchDataset",
)


def dataset_is_batched(dataset):
    """True / False when the pipeline shows it, None when it cannot tell.

    Walks the chain of input datasets: a batching stage means batched; a chain
    rooted at `from_tensor_slices` with no batching stage means unbatched.
    """
    current = dataset
    while current is not None:
        name = type(current).__name__
        if name == "_UnbatchDataset":
            return False
        if name in _BATCHING_DATASETS:
            return True
        if name == "_TensorSliceDataset":
            return False
        try:
            inputs = current._inputs()
        except Exception:  # pragma: no cover - unknown dataset kinds
            return None
        current = inputs[0] if inputs else None
    return None


# Dataset operations that draw their seeds from a seed generator resource
# each time an iterator is made (a reshuffling `shuffle`, `Dataset.random`):
# {op: (index of seed, of seed2, of the generator input; the attribute that
# says whether each iteration draws anew)}.
_SEEDED_DATASET_OPS = {
    "ShuffleDatasetV3": (2, 3, 4, "reshuffle_each_iteration"),
    "RandomDatasetV2": (0, 1, 2, "rerandomize_each_iteration"),
}


def dataset_with_own_seeds(dataset):
    """A copy of `dataset` whose iteration leaves `dataset`'s seed
    generators as they are, or None when `dataset` has none (or its
    pipeline cannot be copied: it is then read itself).

    A reshuffling `shuffle(seed=...)` draws the order of each iteration from
    a generator that the dataset object holds: one element read from a
    fresh iterator moves it on, so the next `fit` would see the order of
    the second iteration, not the first. The copy is the same pipeline
    (serialized and rebuilt) with a fresh generator of the same seeds: its
    first iteration gives the first order, and the user's dataset still
    gives it too.

    Example:
        >>> ds = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(4)
        >>> copy = dataset_with_own_seeds(ds)
        >>> next(iter(copy)).numpy().tolist() == next(iter(ds)).numpy().tolist()
        True
    """
    try:
        serialized = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=1,  # IGNORE: a generator's function is called anew
            strip_device_assignment=True)
        graph = tf.compat.v1.GraphDef.FromString(serialized.numpy())
    except (tf.errors.OpError, ValueError, TypeError):
        return None
    nodes = [node for node in graph.node if node.op in _SEEDED_DATASET_OPS]
    for node in nodes:
        seed, seed2, generator, attribute = _SEEDED_DATASET_OPS[node.op]
        if len(node.input) <= generator:
            return None
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
    if not nodes:
        return None
    try:
        variant = tf.raw_ops.DatasetFromGraph(graph_def=graph.SerializeToString())
        return tf.data.experimental.from_variant(variant, dataset.element_spec)
    except (tf.errors.OpError, ValueError, TypeError):
        return None


def dataset_strategy(dataset):
    """The strategy a distributed dataset was made by, or None."""
    return getattr(dataset, "_strategy", None)
