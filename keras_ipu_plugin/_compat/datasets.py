"""`tf.data` pipelines: whether one is batched, its strategy.

Part of `_compat`, the one package that touches private Keras / TensorFlow
APIs (see its `__init__`)."""


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


def dataset_strategy(dataset):
    """The strategy a distributed dataset was made by, or None."""
    return getattr(dataset, "_strategy", None)


def stateful_op_names(graph_def):
    """The names of the stateful ops (by TensorFlow's op registry) among
    the nodes of `graph_def` and of the functions of its library: a
    serialized `tf.data` pipeline's, to see what reading it may change.

    Example:
        >>> stateful_op_names(graph_of(dataset.map(lambda x: x + gen.normal(()))))
        {'RngReadAndSkip', 'AssignVariableOp', 'VarHandleOp', 'RangeDataset', ...}
    """
    from tensorflow.python.framework import op_def_registry

    nodes = [*graph_def.node, *(node for function in graph_def.library.function
                                for node in function.node_def)]
    return {node.op for node in nodes
            if getattr(op_def_registry.get(node.op), "is_stateful", False)}
