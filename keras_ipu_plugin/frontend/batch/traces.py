"""A `call` that needs its batch size as a number, traced at two of them
and made one graph for any batch size (batch generalisation).

The batch size is unknown (None) while tracing. An operation given it in a
shape (`ops.broadcast_to(cls, (ops.shape(x)[0], 1, d))`) becomes a
`BatchSizedOperation` that reads it when the graph runs (`trace/call_trace.py`);
a `call` that needs it as a number (`ops.broadcast_to` on a concrete mask,
as keras_hub's decoders build their causal masks) is traced here at two
batch sizes and the two graphs are made one (`generalization.generalize_batch`).
Both are checked by replaying the shapes at two other batch sizes
(`shapes.py`); what fails stays whole, with a reason saying to pass
`static_batch=True`. A call that divides the batch size is traced at
multiples of what it divides by (`divided_trial_sizes`, `divisions.py`).

When a call is traced so is the `Tracer`'s to say (`Tracer.traces`); each
function here takes the symbolic trace of the call (a `CallTrace`) and
gives `Traces`, whose `trial` (a `BatchTrial`) says how they were made.

Example:
    ```python
    traces = trace_at_two_batch_sizes(call, error)
    nodes, outputs = one_graph_for_any_batch(traces)
    ```
"""

import dataclasses
import math

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.frontend.batch.divisions import LARGEST_DIVISOR
from keras_ipu_plugin.frontend.batch.divisions import ProbeTensor
from keras_ipu_plugin.frontend.batch.divisions import divisibility_guards
from keras_ipu_plugin.frontend.batch.generalization import MixedLeadingSizes
from keras_ipu_plugin.frontend.batch.generalization import NotBatchGeneral
from keras_ipu_plugin.frontend.batch.generalization import batch_signature
from keras_ipu_plugin.frontend.batch.generalization import generalize_batch
from keras_ipu_plugin.frontend.batch.generalization import has_offsets
from keras_ipu_plugin.frontend.batch.generalization import progression_signature
from keras_ipu_plugin.frontend.batch.shapes import check_batch_dimensions
from keras_ipu_plugin.frontend.trace.call_trace import Traces
from keras_ipu_plugin.frontend.trace.call_trace import anchor_of
from keras_ipu_plugin.frontend.trace.failures import ModeStructureError
from keras_ipu_plugin.frontend.trace.failures import TraceError
from keras_ipu_plugin.frontend.trace.training_modes import with_branch_nodes
from keras_ipu_plugin.frontend.trace.training_modes import trace_modes
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw


# The batch sizes a call is traced at when its symbolic trace fails on the
# unknown batch size (see `trace_at_two_batch_sizes`). One of them is 1, so
# that Python code branching on the batch size (`if ops.shape(x)[0] > 1`)
# takes different branches in the two traces and is refused, not baked in.
# A size with a constant added to the batch's (`batch + 1`) is confirmed by
# traces at the second pair.
TRIAL_BATCH_SIZES = (1, 3)
CONFIRMING_BATCH_SIZES = (1, 2)
# A range over the batch (`ops.arange(ops.shape(x)[0])`) seen counting in
# the trial traces is confirmed by traces at larger batch sizes: three rows
# that count may wrap after (`ops.arange(b) % 3`).
RANGE_CONFIRMING_BATCH_SIZES = (2, 7)

# The leading sizes of each input in the two traces of a call whose inputs'
# leading dimensions may be independent of each other (`per_input`): one
# pair per input, the first `TRIAL_BATCH_SIZES`. Their ratios differ, so a
# dimension that follows one input's size, or a multiple of it, follows no
# other's, and the graph tells which input each size is read from.
PER_INPUT_SIZES = ((1, 3), (2, 5), (4, 11), (6, 17), (8, 23), (10, 29))


# The size the probe trace gives its inputs' leading dimension: that of the
# second trial trace, so that code branching on a batch of one does not
# hide the division.
PROBE_SIZE = TRIAL_BATCH_SIZES[1]


@dataclasses.dataclass(frozen=True)
class BatchTrial:
    """How traces of a call at trial batch sizes were made (`Traces.trial`).

    `call`: the symbolic trace of the call they stand in for; `sizes`: the
    batch sizes traced at; `failure`: why the symbolic trace failed (None
    for traces that confirm a graph); `groups`: for inputs traced at sizes
    of their own, `[(input Value, its two sizes)]`, one per group of
    inputs, else None; `group_of`: {id(input Value): its group};
    `generalized`: the `(nodes, outputs)` already made one graph of them
    (traced per input, they are made one to tell the grouping).
    """

    call: object
    sizes: tuple
    failure: object
    groups: object = None
    group_of: dict = dataclasses.field(default_factory=dict)
    generalized: object = None


def generalized(traces):
    """`generalize_batch` of the two `traces` made at trial batch sizes
    (or, traced per input, at each input's sizes)."""
    (first, small), (_, large) = traces.runs
    return generalize_batch(small, large, traces.trial.sizes,
                            first.placeholders[id(first.anchor)], traces.trial.call.prefix,
                            groups=traces.trial.groups)


def _sizes_followed(traces):
    """Whether every output of the two per-input `traces` has, at each
    dimension, one size in both, or one input's two sizes (or a multiple of
    them): a call that cannot run with its inputs' sizes different may
    still trace, Keras's shape inference not checking every operation (an
    attention between two inputs gives a size in one trace and None in the
    other), and its inputs are then one batch."""
    (_, (nodes_a, _)), (_, (nodes_b, _)) = traces.runs
    pairs = [sizes for _, sizes in traces.trial.groups]
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


def trace_at_two_batch_sizes(call, error, batch_sizes=TRIAL_BATCH_SIZES, per_input=False,
                             blocks=None, make_input=None):
    """`Traces` of `call` (the symbolic `CallTrace` of a call) with its
    inputs' unknown batch size set to each of `batch_sizes`, for `call`s that need a
    concrete batch size (`ops.broadcast_to(mask, (ops.shape(x)[0], n, n))`
    on a concrete mask, as keras_hub's decoders build their causal masks).
    `generalize_batch` then makes one graph of the two that works for any
    batch size, or says why it cannot. Re-raises `error` (why the symbolic
    trace failed) when the inputs' batch size is known.

    With `per_input`, each input whose leading size is unknown is traced
    at sizes of its own (`PER_INPUT_SIZES`; `independent_inputs`), so that
    the graph follows each input's leading size, never one shared batch.
    Where the call cannot run so (it adds two inputs row by row), the
    inputs are grouped, finest grouping first (`_groupings`), each group
    at sizes of its own; the error is raised where no grouping of two or
    more groups traces. `blocks`: one grouping to trace (lists of inputs).
    `make_input(shape, dtype)`: the symbolic input at each trial size (a
    KerasTensor by default; `batch_divisor`'s probe notes divisions).
    """
    args, kwargs, placeholders = call.args, call.kwargs, call.placeholders
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
                traces = trace_at_two_batch_sizes(call, error, blocks=grouping)
            except ModeStructureError:
                raise  # the same at any sizes
            except TraceError:
                continue
            if not _sizes_followed(traces):
                continue
            # Made one graph and replayed here: a grouping whose graph does
            # not follow its inputs' sizes (an einsum of two inputs that
            # TensorFlow's shape inference refuses at two sizes) is no
            # grouping of this call's inputs.
            try:
                nodes, outputs = generalized(traces)
                check_batch_dimensions(nodes, call.prefix, multiples=True,
                                       groups=traces.trial.group_of)
            except MixedLeadingSizes as failure:
                mixed = mixed or failure
                continue
            except (NotBatchGeneral, TraceError):
                continue
            return dataclasses.replace(traces, trial=dataclasses.replace(
                traces.trial, generalized=(nodes, outputs)))
        if mixed is not None:
            # the inputs' sizes are apart, and one graph cannot hold it
            raise TraceError(
                f"{error.reason}; traced with each input at sizes of its own instead, {mixed}",
                mixed=True)
        raise error
    if error is not None and not per_input and blocks is None \
            and independent_inputs(args, kwargs):
        # Inputs whose leading sizes may differ: traced at sizes of their
        # own first, so that a size the call computes with is read from
        # the input it is of; at one shared size only where the call
        # cannot run with them different (it adds them row by row).
        try:
            return trace_at_two_batch_sizes(call, error, per_input=True)
        except TraceError as failure:
            if failure.mixed:
                raise  # one shared size would read one input's size for another's
    runs = []
    groups = list(blocks or [])
    if groups and not 2 <= len(groups) <= len(PER_INPUT_SIZES):
        raise error
    group_of = {id(t): index for index, block in enumerate(groups) for t in block}
    trial = BatchTrial(
        call, tuple(batch_sizes), error.reason if error is not None else None,
        groups=[(placeholders[id(block[0])], PER_INPUT_SIZES[index])
                for index, block in enumerate(groups)] or None,
        group_of={id(placeholders[id(t)]): index
                  for index, block in enumerate(groups) for t in block})
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
        trace = call.at(
            keras.tree.map_structure(swap, args), keras.tree.map_structure(swap, kwargs),
            {id(swap(t)): placeholders[id(t)] for t in symbols}, anchor=concrete[id(anchor)])
        try:
            result = trace_modes(trace)
        except ModeStructureError as failure:
            # Another output structure in each mode, seen once the batch
            # size is known: the same at any batch size, and what the model
            # must hold (`convert.opaque_graph`), or refuse, up front.
            if error is None:
                raise
            raise ModeStructureError(
                f"{error.reason}; traced at batch size {batch_size} instead, {failure.reason}",
                structures=failure.structures) from None
        except TraceError as failure:
            if error is None:  # confirming a generalization: that failure says why not
                raise NotBatchGeneral(f"and at batch size {batch_size} {failure.reason}") from None
            if failure.reason == error.reason:
                raise error from None
            # What stops the trace at a known batch size is the cause to fix
            # (Mixtral's MoE block: `add_loss` in training, after `B*T // T`).
            raise TraceError(f"{error.reason}; traced at batch size {batch_size} instead, "
                             f"{failure.reason}") from None
        runs.append((trace, result))
    return Traces(tuple(runs), trial)


def per_input_traces(symbolic):
    """`symbolic` (the `Traces` of one symbolic trace), or, where that trace
    reads an input's unknown leading size (a `BatchSizedOperation`, a draw
    of the batch size) while two or more inputs have one
    (`independent_inputs`), the call traced at sizes of each input's own:
    one symbolic trace takes every None for the anchor's batch size, and
    GAT's `ops.reshape(x, (ops.shape(edges)[0], -1))` would read the node
    count.

    Where the call cannot run with its inputs' leading sizes different (it
    adds them row by row), they are one batch, and the symbolic trace
    stands. Where it can, the per-input traces decide, and where they are
    not one graph the layer stays whole, with the reason."""
    ((call, (nodes, _)),) = symbolic.runs
    inputs = independent_inputs(call.args, call.kwargs)
    readers = [node.name for node in with_branch_nodes(nodes) if _reads_leading_size(node)]
    if not inputs or not readers:
        return symbolic
    reason = (
        f"`{readers[0]}` reads the unknown leading size of an input (`ops.shape(x)[0]`), "
        f"and {len(inputs)} inputs of the call have one, which may differ")
    try:
        return trace_at_two_batch_sizes(call, TraceError(reason), per_input=True)
    except TraceError as failure:
        if failure.mixed:
            raise  # the symbolic trace would read one input's size for another's
        return symbolic  # fails at independent sizes: the inputs are one batch


def _reads_leading_size(node):
    """Whether `node` fills an unknown dimension from its anchor's leading
    size when the graph runs."""
    operation = node.operation
    if isinstance(operation, BatchSizedOperation):
        return True
    if isinstance(operation, RandomDraw):
        return None in tuple(operation.draw_shape)
    return node.kwargs.get("batch_of") is not None


def _flat_values(structure):
    found = []
    map_values(found.append, structure)
    return found


def batch_divisor(call):
    """The least common multiple of what the traced `call` (a `CallTrace`)
    divides its inputs' leading size by (1 where nothing), seen in one
    trace at `PROBE_SIZE` (`divisions.ProbeTensor`)."""
    divisors = []

    def probe(shape, dtype):
        return ProbeTensor(shape, dtype, divisors)

    try:
        trace_at_two_batch_sizes(call, None, batch_sizes=(PROBE_SIZE,), make_input=probe)
    except Exception:  # noqa: BLE001 - a probe: the trial traces say why a call fails
        pass
    return math.lcm(1, *divisors)


def divided_trial_sizes(call, error):
    """The batch sizes to trace `call` at where it divides its inputs'
    leading size: `TRIAL_BATCH_SIZES` times what it divides by
    (`batch_divisor`); None where it divides by nothing. Past
    `LARGEST_DIVISOR`, raises `TraceError` (`error`: why the symbolic
    trace failed) saying so: at the trial sizes the division would be 0."""
    divisor = batch_divisor(call)
    if divisor == 1:
        return None
    if divisor > LARGEST_DIVISOR:
        raise TraceError(
            f"{error.reason}; `call` divides the batch size by {divisor}, and is traced at "
            f"multiples of a divisor up to {LARGEST_DIVISOR} only (at other sizes the "
            "division is not exact); write the reshape's batch dimension as -1, or convert "
            "with static_batch=True")
    return tuple(divisor * size for size in TRIAL_BATCH_SIZES)


def one_graph_for_any_batch(traces):
    """`(nodes, outputs)` of one graph for any batch size, made of the two
    `traces` at trial batch sizes (`trace_at_two_batch_sizes`), checked to
    follow the batch size (a size that is the batch's plus a constant is
    confirmed by a third trace). Raises `TraceError` saying why the traces
    are not one graph."""
    trial = traces.trial
    if trial.generalized is not None:  # traced per input, and made one graph then
        return trial.generalized
    sizes, prefix = trial.sizes, trial.call.prefix
    # Traced at multiples of what the call divides the batch by
    # (`divided_trial_sizes`): the graph holds there only.
    scale = sizes[0] // TRIAL_BATCH_SIZES[0] if sizes != TRIAL_BATCH_SIZES else 1
    leading = [tuple(value.spec.shape[0] if value.spec.shape else None
                     for value in pair)
               for pair in zip(*(_flat_values(outputs) for _, (_, outputs) in traces.runs))]
    try:
        nodes, outputs = generalized(traces)
        if has_offsets(nodes) or scale > 1:
            # `batch + 1`: two traces fit any line through their sizes (the
            # batch squared too); a third, at another batch size, confirms it.
            confirming = tuple(scale * size for size in CONFIRMING_BATCH_SIZES)
            again = trace_at_two_batch_sizes(trial.call, None, confirming)
            if batch_signature(generalized(again)[0]) != batch_signature(nodes):
                raise NotBatchGeneral(
                    f"and a trace at batch size {confirming[1]} shows a size that is no "
                    "multiple (or fraction) of the batch size plus a constant")
        if progression_signature(nodes):
            confirming = tuple(scale * size for size in RANGE_CONFIRMING_BATCH_SIZES)
            again = generalized(trace_at_two_batch_sizes(trial.call, None, confirming))[0]
            if progression_signature(again) != progression_signature(nodes):
                raise NotBatchGeneral(
                    f"and traces at batch sizes {confirming[0]} and {confirming[1]} show a "
                    "constant computed from the batch size that counts along it otherwise "
                    "than at the first two")
        if scale > 1:
            first = traces.runs[0][0]
            anchor = first.placeholders[id(first.anchor)]
            try:
                guards, outputs = divisibility_guards(outputs, anchor, scale, sizes, leading,
                                                      prefix)
            except ValueError as error:
                raise NotBatchGeneral(str(error)) from None
            nodes = nodes + guards
        check_batch_dimensions(nodes, prefix, multiples=True, groups=trial.group_of,
                               scale=scale)
    except NotBatchGeneral as mismatch:
        at = "" if scale == 1 else (
            f" ({', '.join(map(str, sizes))}: multiples of {scale}, which `call` divides "
            "the batch size by)")
        raise TraceError(
            f"{trial.failure}; traced at two batch sizes{at} instead, {mismatch}"
        ) from None
    return nodes, outputs


__all__ = ["BatchTrial", "CONFIRMING_BATCH_SIZES", "PER_INPUT_SIZES", "PROBE_SIZE",
           "RANGE_CONFIRMING_BATCH_SIZES", "TRIAL_BATCH_SIZES", "batch_divisor",
           "divided_trial_sizes", "independent_inputs",
           "one_graph_for_any_batch", "per_input_traces", "trace_at_two_batch_sizes"]
