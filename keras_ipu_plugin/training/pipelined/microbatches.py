"""Splitting a batch into microbatches, and summing the microbatches'
gradients in the form the whole batch's takes (the pipelined step's
arithmetic, `training/pipelined/step.py`).

Example:
    >>> xs = split(x, 4, "x")                  # 4 equal row slices
    >>> gradient = summed([g0, g1, g2, g3], rows={id(t) for t in xs})
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


def split(structure, count, what):
    """`count` structures of equal row slices of `structure`'s tensors (a
    None stays None in each)."""
    if structure is None:
        return [None] * count
    leaves = tf.nest.flatten(structure)
    pieces = []
    for leaf in leaves:
        if leaf is None:
            pieces.append([None] * count)
            continue
        tensor = tf.convert_to_tensor(leaf)
        rows = tensor.shape[0] if tensor.shape.rank else None
        if tensor.shape.rank == 0:
            raise ValueError(f"PipelineStages(microbatches={count}): `{what}` holds a scalar; "
                             "it cannot be split into microbatches.")
        if rows is not None and rows % count:
            raise ValueError(
                f"PipelineStages(microbatches={count}): a batch of {rows} rows (`{what}`) "
                f"cannot be split into {count} equal microbatches; use a batch size that "
                f"{count} divides (drop_remainder=True on a dataset whose size it does not).")
        if rows is None and not tf.executing_eagerly():
            batch = tf.shape(tensor)[0]
            check = tf.debugging.Assert(
                tf.equal(tf.math.floormod(batch, count), 0),
                [f"PipelineStages(microbatches={count}): a batch of", batch,
                 f"rows (`{what}`) cannot be split into {count} equal microbatches; use a "
                 f"batch size that {count} divides (drop_remainder=True on a dataset whose "
                 f"size it does not)."])
            with tf.control_dependencies([check]):
                tensor = tf.identity(tensor)
        pieces.append(tf.split(tensor, count, axis=0))
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


__all__ = ["per_variable", "split", "summed"]
