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
