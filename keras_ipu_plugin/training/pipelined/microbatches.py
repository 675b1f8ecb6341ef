"""Splitting a batch into microbatches, and summing the microbatches'
gradients in the form the whole batch's takes (the pipelined step's
arithmetic, `training/pipelined/step.py`).

Example:
    ```python
    sizes = slice_sizes(batch_rows(x, 4), 4)   # 10 rows: [3, 3, 2, 2]
    xs = split(x, sizes, "x")
    gradient = summed([g0, g1, g2, g3], rows={id(t) for t in xs})
    ```
"""

import tensorflow as tf


def per_variable(trainable, weights, value_gradients, variable_gradients):
    """The gradient of each of `trainable`: with respect to its value read
    for the stage (`weights`: `(variable, value)` pairs, `value_gradients`
    in their order) plus with respect to the variable itself (a direct
    read), either possibly None."""
    by_value = {id(v): g for (v, _), g in zip(weights, value_gradients)}
    merged = []
    for variable, direct in zip(trainable, variable_gradients):
        through_value = by_value.get(id(variable))
        if through_value is None or direct is None:
            merged.append(direct if through_value is None else through_value)
        elif isinstance(direct, tf.IndexedSlices) or isinstance(through_value, tf.IndexedSlices):
            merged.append(tf.convert_to_tensor(direct) + tf.convert_to_tensor(through_value))
        else:
            merged.append(direct + through_value)
    return merged


def batch_rows(x, count):
    """The rows of batch `x` (its first tensor's): a Python int where the
    shape is known as the step is traced, else a scalar tensor.

    A batch of fewer rows than microbatches (a small last batch) leaves
    some microbatches empty. Where the batch size is known only when the
    step runs (`fit`'s traced step, graph mode or XLA), it trains as plain
    Keras trains it: the step keeps each microbatch's loss, gradients and
    variable writes only if it has rows (`_Run` in step.py), so an empty
    microbatch changes nothing. Where it is known as the step is traced
    (eagerly, `train_on_batch`), Keras's losses and metrics cannot take a
    microbatch of no rows, and the batch is refused naming both sizes.

    Example:
        ```python
        batch_rows(np.zeros((10, 3)), 4)
        # -> 10
        ```
    """
    first = next((leaf for leaf in tf.nest.flatten(x) if leaf is not None), None)
    if first is None:
        raise ValueError(f"PipelineStages(microbatches={count}): the batch has no `x` to split.")
    tensor = tf.convert_to_tensor(first)
    if tensor.shape.rank == 0:
        raise ValueError(f"PipelineStages(microbatches={count}): `x` holds a scalar; "
                         "it cannot be split into microbatches.")
    rows = tensor.shape[0]
    if rows is None and tf.executing_eagerly():
        rows = int(tf.shape(tensor)[0])
    if rows is None:
        return tf.shape(tensor)[0]
    if rows < count:
        raise ValueError(f"PipelineStages(microbatches={count}): a batch of {rows} rows (`x`) "
                         f"is smaller than its {count} microbatches, so a microbatch would be "
                         f"empty; use a batch size of at least {count} (drop_remainder=True on "
                         "a dataset whose last batch would be smaller), or fewer microbatches.")
    return rows


def slice_sizes(rows, count):
    """The rows of each of `count` microbatches of a batch of `rows` rows
    (an int, or a scalar tensor for a batch size known only when the step
    runs): as equal as possible, the first `rows % count` one row longer.

    Example:
        ```python
        slice_sizes(10, 4)
        # -> [3, 3, 2, 2]
        ```
    """
    base, longer = rows // count, rows % count
    if isinstance(rows, int):
        return [base + (1 if m < longer else 0) for m in range(count)]
    return [base + tf.cast(m < longer, rows.dtype) for m in range(count)]


def split(structure, sizes, what):
    """`len(sizes)` structures of consecutive row slices of `structure`'s
    tensors, slice m of `sizes[m]` rows (a None stays None in each). Under
    XLA the sizes, computed from the batch's shape, are compile-time
    constants."""
    count = len(sizes)
    if structure is None:
        return [None] * count
    static = all(isinstance(size, int) for size in sizes)
    split_sizes = sizes if static else tf.stack(sizes)
    pieces = []
    for leaf in tf.nest.flatten(structure):
        if leaf is None:
            pieces.append([None] * count)
            continue
        tensor = tf.convert_to_tensor(leaf)
        if tensor.shape.rank == 0:
            raise ValueError(f"PipelineStages(microbatches={count}): `{what}` holds a scalar; "
                             "it cannot be split into microbatches.")
        pieces.append(tf.split(tensor, split_sizes, num=count, axis=0))
    return [tf.nest.pack_sequence_as(structure, [p[m] for p in pieces]) for m in range(count)]


def summed(parts, rows):
    """The sum of one variable's gradients from the microbatches and stages,
    in the form the whole batch's gradient takes (`rows`: the microbatches'
    input tensors).

    Keras's optimizers are not indifferent to that form: Adam squares an
    IndexedSlices gradient (an Embedding's) slice by slice, before repeated
    indices are summed. So an IndexedSlices sum is made as the whole batch's
    would be: where the gathered indices come from the microbatch's rows
    (token ids), the slices are joined; where they do not (a position
    embedding over `arange(length)`: every microbatch gathers the same
    rows), their values are added slice by slice."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, tf.IndexedSlices) for p in parts):
        return _summed_slices(parts, rows)
    return tf.add_n([tf.convert_to_tensor(p) for p in parts])


def _summed_slices(parts, rows):
    indices = [p.indices for p in parts]
    if tf.executing_eagerly():  # no graph to read: the values tell
        fixed = len({tuple(i.shape) for i in indices}) == 1 and all(
            bool(tf.reduce_all(tf.equal(i, indices[0]))) for i in indices[1:])
    else:
        fixed = not any(_depends_on(i, rows) for i in indices)
    if not fixed:
        return tf.IndexedSlices(tf.concat([p.values for p in parts], 0),
                                tf.concat(indices, 0), parts[0].dense_shape)
    checks = [] if tf.executing_eagerly() else [
        tf.debugging.assert_equal(i, indices[0], message=(
            "pipelined step: the microbatches' gradients of one embedding gather "
            "indices that do not come from their rows, yet differ")) for i in indices[1:]]
    with tf.control_dependencies(checks):
        values = tf.add_n([p.values for p in parts])
    return tf.IndexedSlices(values, indices[0], parts[0].dense_shape)


def _depends_on(tensor, sources):
    """Whether graph tensor `tensor` is computed from any tensor whose id is
    in `sources` (walking the ops' inputs)."""
    seen, stack = set(), [tensor]
    while stack:
        current = stack.pop()
        if id(current) in sources:
            return True
        op = current.op
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(op.inputs)
    return False


__all__ = ["batch_rows", "per_variable", "slice_sizes", "split", "summed"]
