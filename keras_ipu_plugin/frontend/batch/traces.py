"""A `call` that needs its batch size as a number, traced at two of them
and made one graph for any batch size (batch generalisation).

The batch size is unknown (None) while tracing. An operation given it in a
shape (`ops.broadcast_to(cls, (ops.shape(x)[0], 1, d))`) becomes a
`BatchSizedOperation` that reads it when the graph runs (`keras_nodes.py`);
a `call` that needs it as a number (`ops.broadcast_to` on a concrete mask,
as keras_hub's decoders build their causal masks) is traced here at two
batch sizes and the two graphs are made one (`batch_generalization.generalize_batch`).
Both are checked by replaying the shapes at two other batch sizes
(`batch_shapes.py`); what fails stays whole, with a reason saying to pass
`static_batch=True`.

Example:
    >>> runs = trace_at_two_batch_sizes(layer, (x,), {}, placeholders, "", reads,
    ...                                 None, error, tracer)
    >>> nodes, outputs = one_graph_for_any_batch(runs, retrace, "")
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.batch.guards import divisibility_guards
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend.trace.call_trace import CallTrace
from keras_ipu_plugin.frontend.trace.call_trace import anchor_of
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.training_modes import node_identity
from keras_ipu_plugin.frontend.trace.training_modes import trace_modes
from keras_ipu_plugin.frontend.batch.generalization import MixedLeadingSizes
from keras_ipu_plugin.frontend.batch.generalization import NotBatchGeneral
from keras_ipu_plugin.frontend.batch.generalization import batch_signature
from keras_ipu_plugin.frontend.batch.generalization import generalize_batch
from keras_ipu_plugin.frontend.batch.generalization import has_offsets


# The batch sizes a call is traced at when its symbolic trace fails on the
# unknown batch size (see `trace_at_two_batch_sizes`). One of them is 1, so
# that Python code branching on the batch size (`if ops.shape(x)[0] > 1`)
# takes different branches in the two traces and is refused, not baked in.
# A size with a constant added to the batch's (`batch + 1`) is confirmed by
# traces at the second pair.
TRIAL_BATCH_SIZES = (1, 3)
CONFIRMING_BATCH_SIZES = (1, 2)

# The leading sizes of each input in the two traces of a call whose inputs'
# leading dimensions may be independent of each other (`per_input`): one
# pair per input, the first `TRIAL_BATCH_SIZES`. Their ratios differ, so a
# dimension that follows one input's size, or a multiple of it, follows no
# other's, and the graph tells which input each size is read from.
PER_INPUT_SIZES = ((1, 3), (2, 5), (4, 11), (6, 17), (8, 23), (10, 29))


def generalized(runs, batch_sizes, prefix):
    """`generalize_batch` of the two traces `runs` made at `batch_sizes`
    (or, traced `per_input`, at each input's sizes)."""
    (first, small), (_, large) = runs
    return generalize_batch(small, large, batch_sizes, first.placeholders[id(first.anchor)],
                            same_operation, prefix, groups=first.batch_groups)


def input_groups(runs):
    """{id(input Value): index} of the inputs traced at sizes of their own
    (`per_input`), for `check_batch_dimensions`; {} otherwise."""
    return getattr(runs[0][0], "group_of", None) or {}


def _sizes_followed(runs):
    """Whether every output of the two per-input traces `runs` has, at each
    dimension, one size in both, or one input's two sizes (or a multiple of
    them): a call that cannot run with its inputs' sizes different may
    still trace, Keras's shape inference not checking every operation (an
    attention between two inputs gives a size in one trace and None in the
    other), and its inputs are then one batch."""
    (first, (nodes_a, _)), (_, (nodes_b, _)) = runs
    pairs = [sizes for _, sizes in first.batch_groups]
    if len(nodes_a) != len(nodes_b):
        return False
    for node_a, node_b in zip(nodes_a, nodes_b):
        if len(node_a.outputs) != len(node_b.outputs):
            return False
        for value_a, value_b in zip(node_a.outputs, node_b.outputs):
            shape_a, shape_b = tuple(value_a.spec.shape), tuple(value_b.spec.shape)
            if len(shape_a) != len(shape_b):
                return False
            for a, b in zip(shape_a, shape_b):
                if a == b:
                    continue
                if a is None or b is None or not any(
                        a % small == 0 and b == a // small * large for small, large in pairs):
                    return False
    return True


# Beyond this many inputs with an unknown leading size, only all apart and
# all one batch are tried (the groupings of n inputs grow faster than 2**n,
# each a pair of traces; 3 inputs have 4 groupings of two groups or more).
_MOST_GROUPED = 3


def _groupings(inputs):
    """The ways to group `inputs` (lists of lists, each list one group of
    inputs taken to share a leading size), with two groups or more, most
    groups first: all apart first, one batch never (the caller's default)."""
    if len(inputs) > _MOST_GROUPED:
        return [[[t] for t in inputs]]

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for partition in partitions(rest):
            yield [[first]] + partition
            for index in range(len(partition)):
                yield partition[:index] + [[first] + partition[index]] + partition[index + 1:]

    found = [p for p in partitions(list(inputs)) if len(p) >= 2]
    return sorted(found, key=lambda p: -len(p))


def independent_inputs(args, kwargs):
    """The distinct symbolic inputs of a call whose leading (batch)
    dimension is unknown, the anchor first, when there are two or more and
    every other dimension is known: their leading sizes may be independent
    of each other (a graph's node features and edge list), which one
    symbolic trace cannot tell apart; else []."""
    symbols = [leaf for leaf in keras.tree.flatten((args, kwargs))
               if isinstance(leaf, keras.KerasTensor)]
    anchor = anchor_of((args, kwargs))
    batched = []
    for tensor in [anchor] + symbols:
        if tensor is not None and tensor.shape and tensor.shape[0] is None and not any(
                tensor is seen for seen in batched):
            batched.append(tensor)
    if len(batched) < 2 or any(None in tuple(t.shape)[1:] for t in symbols):
        return []
    return batched


def trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix, reads,
                             training, error, tracer, batch_sizes=TRIAL_BATCH_SIZES,
                             per_input=False, blocks=None, make_input=None):
    """Trace `call` with its inputs' unknown batch size set to each of
    `TRIAL_BATCH_SIZES`, for `call`s that need a concrete batch size
    (`ops.broadcast_to(mask, (ops.shape(x)[0], n, n))` on a concrete mask,
    as keras_hub's decoders build their causal masks). `generalize_batch`
    then makes one graph of the two that works for any batch size, or says
    why it cannot. Re-raises `error` when the inputs' batch size is known.
    `tracer`: the `Tracer` of the trace that failed.

    With `per_input`, each input whose leading size is unknown is traced
    at sizes of its own (`PER_INPUT_SIZES`; `independent_inputs`), so that
    the graph follows each input's leading size, never one shared batch.
    Where the call cannot run so (it adds two inputs row by row), the
    inputs are grouped, finest grouping first (`_groupings`), each group
    at sizes of its own; the error is raised where no grouping of two or
    more groups traces. `blocks`: one grouping to trace (lists of inputs).
    `make_input(shape, dtype)`: the symbolic input at each trial size (a
    KerasTensor by default; `batch_divisions`' probe notes divisions).

    Returns `[(trace, (nodes, outputs))]` for each batch size.
    """
    symbols = [leaf for leaf in keras.tree.flatten((args, kwargs))
               if isinstance(leaf, keras.KerasTensor)]
    anchor = anchor_of((args, kwargs))
    batched = [t for t in symbols if t.shape and t.shape[0] is None]
    if not any(t is anchor for t in batched) or any(
        None in tuple(t.shape)[1:] for t in symbols
    ):
        raise error  # no unknown batch size to set, or other unknown sizes
    if per_input and blocks is None:
        mixed = None
        for grouping in _groupings(independent_inputs(args, kwargs)):
            try:
                runs = trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix,
                                                reads, training, error, tracer, blocks=grouping)
            except TraceError:
                continue
            if not _sizes_followed(runs):
                continue
            # Made one graph and replayed here: a grouping whose graph does
            # not follow its inputs' sizes (an einsum of two inputs that
            # TensorFlow's shape inference refuses at two sizes) is no
            # grouping of this call's inputs.
            try:
                nodes, outputs = generalized(runs, None, prefix)
                check_batch_dimensions(nodes, prefix, multiples=True, groups=input_groups(runs))
            except MixedLeadingSizes as failure:
                mixed = mixed or failure
                continue
            except (NotBatchGeneral, TraceError):
                continue
            runs[0][0].generalized = (nodes, outputs)
            return runs
        if mixed is not None:
            failure = TraceError(
                f"{error.reason}; traced with each input at sizes of its own instead, {mixed}")
            failure.mixed = True  # the inputs' sizes are apart, and one graph cannot hold it
            raise failure
        raise error
    if error is not None and not per_input and blocks is None \
            and independent_inputs(args, kwargs):
        # Inputs whose leading sizes may differ: traced at sizes of their
        # own first, so that a size the call computes with is read from
        # the input it is of; at one shared size only where the call
        # cannot run with them different (it adds them row by row).
        try:
            return trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix, reads,
                                            training, error, tracer, per_input=True)
        except TraceError as failure:
            if getattr(failure, "mixed", False):
                raise  # one shared size would read one input's size for another's
    runs = []
    groups = list(blocks or [])
    if groups and not 2 <= len(groups) <= len(PER_INPUT_SIZES):
        raise error
    group_of = {id(t): index for index, block in enumerate(groups) for t in block}
    make_input = make_input or (lambda shape, dtype: keras.KerasTensor(shape, dtype=dtype))
    for run, batch_size in enumerate(batch_sizes):
        concrete = {
            id(t): make_input(
                (PER_INPUT_SIZES[group_of[id(t)]][run] if groups else batch_size,)
                + tuple(t.shape)[1:], t.dtype)
            for t in batched
        }
        swap = lambda leaf: concrete.get(id(leaf), leaf)  # noqa: E731
        for tensor in batched:  # the masks the inputs carry, at this batch size
            mask = _compat.keras_mask(tensor)
            if isinstance(mask, keras.KerasTensor):
                _compat.set_keras_mask(concrete[id(tensor)], swap(mask))
        trace = CallTrace(
            layer, keras.tree.map_structure(swap, args), keras.tree.map_structure(swap, kwargs),
            {id(swap(t)): placeholders[id(t)] for t in symbols},
            prefix, reads, anchor=concrete[id(anchor)], tracer=tracer,
        )
        trace.failure = error.reason if error is not None else None
        trace.trial_sizes = tuple(batch_sizes)
        trace.batch_groups = [(placeholders[id(block[0])], PER_INPUT_SIZES[index])
                              for index, block in enumerate(groups)] or None
        trace.group_of = {id(placeholders[id(t)]): index
                          for index, block in enumerate(groups) for t in block}
        try:
            runs.append((trace, trace_modes(trace, training)))
        except TraceError as failure:
            if error is None:  # confirming a generalization: that failure says why not
                raise NotBatchGeneral(f"and at batch size {batch_size} {failure.reason}") from None
            if failure.reason == error.reason:
                raise error from None
            # What stops the trace at a known batch size is the cause to fix
            # (Mixtral's MoE block: `add_loss` in training, after `B*T // T`).
            raise TraceError(f"{error.reason}; traced at batch size {batch_size} instead, "
                             f"{failure.reason}") from None
    return runs


def per_input_runs(runs, layer, args, kwargs, placeholders, prefix, reads, training, tracer):
    """`runs` (one symbolic trace), or, where that trace reads an input's
    unknown leading size (a `BatchSizedOperation`, a draw of the batch
    size) while two or more inputs have one (`independent_inputs`), the
    call traced at sizes of each input's own: one symbolic trace takes
    every None for the anchor's batch size, and GAT's
    `ops.reshape(x, (ops.shape(edges)[0], -1))` would read the node count.

    Where the call cannot run with its inputs' leading sizes different (it
    adds them row by row), they are one batch, and the symbolic trace
    stands. Where it can, the per-input traces decide, and where they are
    not one graph the layer stays whole, with the reason."""
    from keras_ipu_plugin.frontend.trace.training_branches import with_branch_nodes

    inputs = independent_inputs(args, kwargs)
    readers = [node.name for _, (nodes, _) in runs for node in with_branch_nodes(nodes)
               if _reads_leading_size(node)]
    if not inputs or not readers:
        return runs
    reason = (
        f"`{readers[0]}` reads the unknown leading size of an input (`ops.shape(x)[0]`), "
        f"and {len(inputs)} inputs of the call have one, which may differ")
    try:
        return trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix, reads,
                                        training, TraceError(reason), tracer, per_input=True)
    except TraceError as failure:
        if getattr(failure, "mixed", False):
            raise  # the symbolic trace would read one input's size for another's
        return runs  # fails at independent sizes: the inputs are one batch


def _reads_leading_size(node):
    """Whether `node` fills an unknown dimension from its anchor's leading
    size when the graph runs."""
    from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
    from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw

    operation = node.operation
    if isinstance(operation, BatchSizedOperation):
        return True
    if isinstance(operation, RandomDraw):
        return None in tuple(operation.draw_shape)
    return node.kwargs.get("batch_of") is not None


def _flat_values(structure):
    from keras_ipu_plugin.ir.graph import map_values

    found = []
    map_values(found.append, structure)
    return found


def same_operation(node_a, node_b):
    """Whether two traces called the same thing at these nodes (opaque ones
    are kept out: their recorded output shapes hold a trial batch size)."""
    return node_a.opaque_reason is None and node_identity(node_a) == node_identity(node_b)


def one_graph_for_any_batch(runs, retrace, prefix):
    """`(nodes, outputs)` of one graph for any batch size, made of the two
    traces `runs` (`trace_at_two_batch_sizes`), checked to follow the batch
    size; `retrace(batch_sizes)` traces again at other batch sizes (a size
    that is the batch's plus a constant is confirmed by a third trace).
    Raises `TraceError` saying why the traces are not one graph."""
    done = getattr(runs[0][0], "generalized", None)
    if done is not None:  # traced per input, and made one graph then
        return done
    sizes = getattr(runs[0][0], "trial_sizes", TRIAL_BATCH_SIZES)
    # Traced at multiples of what the call divides the batch by
    # (`batch_divisions.divided_trial_sizes`): the graph holds there only.
    scale = sizes[0] // TRIAL_BATCH_SIZES[0] if sizes != TRIAL_BATCH_SIZES else 1
    leading = [tuple(value.spec.shape[0] if value.spec.shape else None
                     for value in pair)
               for pair in zip(*(_flat_values(outputs) for _, (_, outputs) in runs))]
    try:
        nodes, outputs = generalized(runs, sizes, prefix)
        if has_offsets(nodes) or scale > 1:
            # `batch + 1`: two traces fit any line through their sizes (the
            # batch squared too); a third, at another batch size, confirms it.
            confirming = tuple(scale * size for size in CONFIRMING_BATCH_SIZES)
            again = retrace(confirming)
            if batch_signature(generalized(again, confirming, prefix)[0]) != \
                    batch_signature(nodes):
                raise NotBatchGeneral(
                    f"and a trace at batch size {confirming[1]} shows a size that is no "
                    "multiple (or fraction) of the batch size plus a constant")
        if scale > 1:
            anchor = runs[0][0].placeholders[id(runs[0][0].anchor)]
            try:
                guards, outputs = divisibility_guards(outputs, anchor, scale, sizes, leading,
                                                      prefix)
            except ValueError as error:
                raise NotBatchGeneral(str(error)) from None
            nodes = nodes + guards
        check_batch_dimensions(nodes, prefix, multiples=True, groups=input_groups(runs),
                               scale=scale)
    except NotBatchGeneral as mismatch:
        at = "" if scale == 1 else (
            f" ({', '.join(map(str, sizes))}: multiples of {scale}, which `call` divides "
            "the batch size by)")
        raise TraceError(
            f"{runs[0][0].failure}; traced at two batch sizes{at} instead, {mismatch}"
        ) from None
    return nodes, outputs


__all__ = ["TRIAL_BATCH_SIZES", "CONFIRMING_BATCH_SIZES", "PER_INPUT_SIZES",
           "independent_inputs", "trace_at_two_batch_sizes", "one_graph_for_any_batch",
           "same_operation"]
