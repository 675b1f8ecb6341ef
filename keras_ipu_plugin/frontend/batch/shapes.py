"""Whether a traced graph's unknown dimensions are the batch size.

A graph traced with the batch size unknown (None) holds operations that
read it when the graph runs (`BatchSizedOperation`); one traced at two batch
sizes holds each multiple of it (`generalization.generalize_batch`). Either is
checked here by replaying the shapes with the inputs' batch size set to 3
and then 7 (`check_batch_dimensions`): a dimension that merely stood where
the batch size did would take a wrong value, and fails the trace.

Example:
    ```python
    check_batch_dimensions(nodes, "block.")   # raises TraceError, or sets the specs
    ```
"""

import functools
from fractions import Fraction

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.trace.failures import STATIC_BATCH_HINT
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.failures import essential_message
from keras_ipu_plugin.frontend.trace.trace_views import precise_specs
from keras_ipu_plugin.frontend.trace.trace_views import states_own_output_shape
from keras_ipu_plugin.ir.graph import map_values


# The leading sizes the inputs are replayed at, a pair per input whose
# leading size is independent of the others' (see `groups`); the first is
# the batch size of every other input. The ratios differ, so a dimension
# that follows one input's size (or a multiple of it) follows no other's.
REPLAY_SIZES = ((3, 7), (5, 11), (13, 23), (17, 31), (19, 37), (29, 53))


def check_batch_dimensions(nodes, prefix, multiples=False, groups=None, scale=1):
    """Raise `TraceError` unless every unknown dimension in `nodes` is the
    batch size of the traced call's inputs (what a `BatchSizedOperation`
    fills in when the graph runs).

    The nodes are replayed with the inputs' batch size set to 3 and then 7:
    each dimension of each output must then be the same in both (a fixed
    size, matching the trace where it knew it) or 3 and 7 (the batch size).
    A dimension that merely stood where the batch size did (the batch times
    the sequence, after a reshape) would take a wrong value, and fails here.
    With `multiples` (a graph made from traces at two batch sizes, whose
    operations hold each multiple of the batch size they compute with,
    `generalization.BatchMultiple`), a dimension may be a fixed multiple of
    the batch size too (3k and 7k: Swin's `batch * windows` rows).
    The outputs' shapes are then set to what the replay showed.

    `groups` ({id(input Value): index}): inputs whose leading sizes are
    independent of each other (a graph's node features and its edge list,
    traced at sizes of their own: `generalization.generalize_batch`)
    are replayed each at sizes of its own (`REPLAY_SIZES`), and each
    dimension must follow one of them: an operation reading the wrong
    input's size fails here, which one shared batch size would hide. An
    input not in `groups` has the first group's sizes.

    `scale`: the batch sizes the graph was traced at are multiples of it
    (the call divides the batch by it, `batch/divisions.py`); it is
    replayed at multiples of it too, and a dimension may be a fraction of
    the batch size (3k / w and 7k / w: Swin's `batch_windows // windows`).
    """
    groups = groups or {}
    pairs = [tuple(scale * size for size in pair)
             for pair in REPLAY_SIZES[:max(groups.values(), default=0) + 1]]
    shapes = [_replayed_shapes(nodes, prefix, [pair[run] for pair in pairs], groups)
              for run in (0, 1)]
    for node in nodes:
        for value in node.outputs:
            small, large = shapes[0][id(value)], shapes[1][id(value)]
            recorded = tuple(value.spec.shape)
            if len(small) != len(recorded) or not all(
                (a == b and c in (None, a))  # a fixed size
                or (c is None and a is not None and b is not None and any(
                    (a, b) == (s, l)  # an input's leading size
                    # a multiple (or, with `scale`, a fraction) of it
                    or (multiples and a > 0 and a * l == b * s)
                    for s, l in pairs))
                # a multiple plus a constant (`batch + 1`), confirmed by a trace
                or (multiples and len(pairs) == 1 and c is None and a is not None
                    and b is not None and b > a and _on_a_line(a, b, pairs[0]))
                for a, b, c in zip(small, large, recorded)
            ):
                raise TraceError(_unknown_dimension_reason(node.name, value))
            # What the trace did not know (reshape to `(batch, -1, ...)`)
            # the replay showed: later traces of the graph start from it.
            value.spec = keras.KerasTensor(
                tuple(None if a != b else a for a, b in zip(small, large)),
                dtype=value.spec.dtype, sparse=value.spec.sparse,
            )


def _on_a_line(a, b, sizes):
    """Whether `(a, b)` at the batch sizes `sizes` is a multiple (or a
    fraction) of the batch size plus an integer constant."""
    small, large = sizes
    slope = Fraction(b - a, large - small)
    return (a - slope * small).denominator == 1


def _replayed_shapes(nodes, prefix, batch_sizes, groups):
    """`{id(Value): shape}` of `nodes`' outputs, worked out by Keras with the
    inputs' (leading, unknown) batch dimension set to `batch_sizes[group]`
    (`groups`: {id(input Value): group}; 0 for an input not in it)."""
    replayed, shapes = {}, {}

    def known(value):
        if id(value) not in replayed:  # an input of the traced call
            shape = tuple(value.spec.shape)
            if any(dim is None for dim in shape[1:]):
                raise TraceError(_unknown_dimension_reason(prefix.rstrip("."), value))
            if shape and shape[0] is None:
                shape = (batch_sizes[groups.get(id(value), 0)],) + shape[1:]
            replayed[id(value)] = keras.KerasTensor(shape, dtype=value.spec.dtype)
        return replayed[id(value)]

    for node in nodes:
        args = map_values(known, node.args)
        kwargs = map_values(known, node.kwargs)
        operation = node.operation
        compute_output_spec = operation.compute_output_spec
        if isinstance(operation, keras.layers.Layer) and not states_own_output_shape(
            type(operation)
        ):  # its `call` run in a scratch graph; not `Layer.compute_output_spec`,
            # which asks an inherited `compute_output_shape` (one output, where
            # keras_hub's `ESMRotaryEmbedding.call` returns two)
            compute_output_spec = functools.partial(
                _compat.Operation.compute_output_spec, operation)
        try:
            # A None among a layer's outputs (T5's attention without a cache)
            # is no Value of its node (`Node.output_structure` keeps it).
            outputs = [t for t in keras.tree.flatten(compute_output_spec(*args, **kwargs))
                       if t is not None]
        except Exception as error:
            raise TraceError(
                f"{STATIC_BATCH_HINT} (the graph uses the batch size, and the "
                f"shapes of `{node.name}` cannot be checked to follow it: "
                f"{type(error).__name__}: {essential_message(error, limit=200)})"
            ) from error
        # As in the trace (`collect_nodes`): a layer that leaves a dimension
        # unknown although its inputs know theirs (`EinsumDense(output_shape=
        # (None, f))` leaves the sequence out) is asked TensorFlow's shape
        # inference, or the replay could not tell that dimension is fixed.
        outputs = precise_specs(operation, args, kwargs, outputs)
        if len(outputs) != len(node.outputs):
            raise TraceError(
                f"{STATIC_BATCH_HINT} (the graph uses the batch size, and the shapes "
                f"of `{node.name}` cannot be checked to follow it: it makes "
                f"{len(outputs)} outputs at another batch size, {len(node.outputs)} in the trace)")
        for value, tensor in zip(node.outputs, outputs):
            replayed[id(value)] = tensor
            shapes[id(value)] = tuple(tensor.shape)
    return shapes


def _unknown_dimension_reason(where, value):
    return (
        f"{STATIC_BATCH_HINT} (the graph computes with the batch size, but "
        f"`{where or 'the input'}` has a tensor of shape {tuple(value.spec.shape)} "
        "whose unknown dimension is not the batch size alone)"
    )
