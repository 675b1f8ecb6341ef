"""The one module that touches private Keras / TensorFlow APIs.

Keras 3 exposes no public way to do what the plugin is for, so this module
gives each private access a name that says what it is for:

- tracing: run a layer's `call` under a chosen training context, walk and
  undo the nodes a symbolic call records (`call_context`, `producing_node`,
  `node_lists_snapshot`, `record_call`, ...); let TensorFlow's dispatch see
  symbolic tensors (`make_dispatchable`, `tf_elementwise_functions`); name
  the Keras objects the trace-time idioms wrap (`traced_idiom_targets`: the
  wrappers are tracing behaviour, in `frontend/traced_idioms.py`);
- the functional model: subclass it, run its graph with our own operation
  hook, read its nodes and output structure (`Functional`,
  `run_functional_graph`, `functional_nodes`, `output_structure`, ...);
- optimizers: extend a built optimizer's state for new variables and move
  state between variables (`optimizer_slot_lists`, `transplant_optimizer_state`);
- distribution, data and state: a variable's strategy, whether a dataset is
  batched, TensorFlow's tracked containers, the global seed generator.

No other module imports `keras.src` or `tensorflow.python`, or reads a
private attribute of an object it did not make (`tests/test_layering.py`
checks both), so a Keras upgrade is a change in this file.

It is one concept over ~600 lines on purpose: the whole quarantine in one file
is what makes that so. What the accesses are used for lives with its users
(the trace-time patches in `frontend/traced_idioms.py`, for one).
"""

import contextlib
import functools
import inspect
import re
import sys
import threading
import types

import tensorflow as tf
from tensorflow.python.trackable import data_structures as _tf_data_structures

from keras.src.backend.common import global_state
from keras.src.layers.layer import CallContext
from keras.src.models.functional import Functional  # noqa: F401 (the base class of KipFunctional)
from keras.src.ops.node import Node as KerasNode
from keras.src.ops.operation import Operation  # noqa: F401 (the base class of keras.ops operations)
from keras.src.utils import naming as _naming

_CALL_CTX = "current_call_ctx"


@contextlib.contextmanager
def call_context(entry_layer, training):
    """Run a block as if inside `entry_layer.__call__(..., training=training)`.

    Sub-layers called without an explicit `training` then resolve it from this
    context exactly as they would inside the real `__call__`.
    """
    previous = global_state.get_global_attribute(_CALL_CTX)
    context = CallContext(entry_layer=entry_layer)
    context.set_value("training", training)
    global_state.set_global_attribute(_CALL_CTX, context)
    try:
        yield
    finally:
        global_state.set_global_attribute(_CALL_CTX, previous)


def keras_history(tensor):
    """`(operation, node_index, tensor_index)` of a KerasTensor, or None."""
    return getattr(tensor, "_keras_history", None)


def producing_node(tensor):
    history = keras_history(tensor)
    if history is None:
        return None, None
    operation, node_index, tensor_index = history
    return operation._inbound_nodes[node_index], tensor_index


def node_arguments(node):
    """The `(args, kwargs)` a Keras node was recorded with."""
    return node.arguments.args, node.arguments.kwargs


def node_input_tensors(node):
    """The Keras tensors a Keras node was called on, in its arguments' order."""
    return list(node.arguments.keras_tensors)


def node_outputs(node):
    return list(node.outputs)


def is_input_node(node):
    return node.is_input


class node_lists_snapshot:
    """Undo the node bookkeeping a failed symbolic call leaves on `layers`.

    A symbolic call appends a Node to each called layer's inbound/outbound
    node lists. When a trace fails half way (or is interrupted: Ctrl-C),
    those dangling nodes would stay on the user's layers; leaving the block
    with an exception restores the lists' lengths. With `always=True` they
    are restored on success too (a trace whose result is kept only in our
    IR).

    A class, not a generator: resuming a generator on a clean exit is a
    moment a Ctrl-C can land in, inside its `try`, which would take away
    the nodes of a block that has completed (a conversion already kept).
    It reads the outcome from `__exit__`'s arguments, not `sys.exc_info()`
    (which inside an `except` clause is the caught error).

    Example:
        >>> with node_lists_snapshot(all_layers(model)):
        ...     converted = rebuild(graph)
    """

    def __init__(self, layers, always=False):
        self.lengths = [
            (layer, len(layer._inbound_nodes), len(layer._outbound_nodes))
            for layer in layers
        ]
        self.always = always

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None or self.always:
            self.restore()
        return False

    def restore(self):
        """Drop the nodes recorded since the snapshot."""
        for layer, n_in, n_out in self.lengths:
            del layer._inbound_nodes[n_in:]
            del layer._outbound_nodes[n_out:]


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
        >>> ds = tf.data.Dataset.range(8).shuffle(8, seed=1).batch(4)
        >>> copy = dataset_to_peek(ds)
        >>> next(iter(copy)).numpy().tolist() == next(iter(ds)).numpy().tolist()
        True
    """
    from tensorflow.python.framework import op_def_registry

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
    nodes = [*graph.node, *(node for function in graph.library.function
                            for node in function.node_def)]
    writes = sorted({
        node.op for node in nodes
        if node.op not in _PER_ITERATION_STATEFUL_OPS and not _DATASET_OP.search(node.op)
        and getattr(op_def_registry.get(node.op), "is_stateful", False)})
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


def set_keras_mask(tensor, mask):
    from keras.src import backend

    backend.set_keras_mask(tensor, mask)


def run_functional_graph(model, inputs, mask, operation_fn):
    """`Functional.call`, with a caller-supplied `operation_fn(op) -> callable`.

    Keras 3.10-3.15's `Functional.call` overwrites a `training` value recorded
    on a node (a sub-layer called with a hard-coded `training=False`) with the
    outer `training`; running the graph through our own `operation_fn` lets the
    converted model keep such recorded values.
    """
    from keras import tree

    inputs = model._standardize_inputs(inputs)
    if mask is not None:
        for x, one_mask in zip(inputs, tree.flatten(mask)):
            if one_mask is not None:
                set_keras_mask(x, one_mask)
    outputs = model._run_through_graph(inputs, operation_fn=operation_fn)
    if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
        return outputs[0]
    return outputs


def graph_call_through(model, wrap):
    """`model.call` where it is Keras's run of a graph of layers
    (`Functional.call`, or a built `Sequential`'s, which runs its inner
    functional model), as a function of that `call`'s arguments that calls
    `wrap(operation)` in place of each operation, handing it the call-context
    arguments (`training`) exactly as `Functional.call` does; None for any
    other `call` (a subclass's own).

    Example:
        >>> run = graph_call_through(backbone, lambda op: op)   # same as backbone.call
        >>> outputs = run(inputs, training=True)
    """
    import keras
    from keras.src.models import functional as functional_lib

    call = getattr(type(model), "call", None)
    if call is Functional.call:
        graph = model
    elif (isinstance(model, keras.Sequential) and call is keras.Sequential.call
          and getattr(model, "_functional", None) is not None):
        graph = model._functional
    else:
        return None

    def run(inputs, training=None, mask=None, **kwargs):
        return run_functional_graph(
            graph, inputs, mask,
            lambda op: functional_lib.operation_fn(wrap(op), training=training, **kwargs))

    return run


def call_context_args(operation):
    return getattr(operation, "_call_context_args", ())


def functional_nodes(model):
    """The nodes of a functional model in execution order (inputs excluded)."""
    ordered = []
    for depth in sorted(model._nodes_by_depth, reverse=True):
        for node in model._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                ordered.append(node)
    return ordered


def node_input_ids(node):
    return [id(tensor) for tensor in node.arguments.keras_tensors]


def node_fill_in(node, tensors):
    """`(args, kwargs)` of `node` with its KerasTensors replaced from
    `tensors` (a dict keyed by KerasTensor id)."""
    return node.arguments.fill_in(tensors)


def standardize_inputs(model, inputs):
    return model._standardize_inputs(inputs)


def make_step_function(model, step_function, jit_compile=None):
    """Keras's own train/test function maker (`TensorFlowTrainer._make_function`)
    around `step_function`: distribution, `jit_compile`, `steps_per_execution`
    and `run_eagerly` behave exactly as in `fit` / `evaluate`.

    `jit_compile`: XLA or not for this function where it differs from the
    model's compiled setting (None: the model's). The model is not changed:
    Keras's maker reads the setting from a view of it."""
    if jit_compile is None or bool(jit_compile) == bool(model.jit_compile):
        return model._make_function(step_function)
    return type(model)._make_function(_JitCompileView(model, bool(jit_compile)), step_function)


class _JitCompileView:
    """`model` as Keras's function maker reads it, but for `jit_compile`:
    every other attribute is the model's, read when the function reads it
    (`steps_per_execution` at each call, as on the model)."""

    def __init__(self, model, jit_compile):
        self.__dict__["_model"] = model
        self.__dict__["jit_compile"] = jit_compile

    def __getattr__(self, name):
        return getattr(self.__dict__["_model"], name)


def auto_jit_compile(model):
    """What Keras's `compile(jit_compile="auto")` resolves to for `model` on
    this machine (XLA where there is a GPU and no distribution strategy)."""
    return bool(model._resolve_auto_jit_compile())


# -- optimizer state (no public API extends a built optimizer) ----------------


def optimizer_trainable_variables(optimizer):
    return list(getattr(optimizer, "_trainable_variables", []))


def optimizer_slot_lists(optimizer):
    """`{attribute: list}` of per-variable state lists (one entry per
    trainable variable, e.g. Adam's `_momentums`, EMA's averages)."""
    count = len(optimizer_trainable_variables(optimizer))
    from keras.src.backend.common.variables import Variable

    lists = {}
    for name, value in vars(optimizer).items():
        # `_variables` is the optimizer's own list of everything it holds:
        # an SGD without momentum over two variables holds two (iterations,
        # learning rate), which looked like a per-variable list.
        if name in ("_trainable_variables", "_variables") or not isinstance(value, list):
            continue
        if count and len(value) == count and all(
            item is None or isinstance(item, Variable) for item in value
        ):
            lists[name] = value
    return lists


def transplant_optimizer_state(target, scratch, old_count):
    """Give `target` the state lists of `scratch` (built on target's old
    variables followed by the new ones), keeping target's own non-slot
    variables (iterations, learning rate, ...) and copying the old entries'
    values across."""
    old_lists = optimizer_slot_lists(target)
    new_lists = optimizer_slot_lists(scratch)
    for name, old in old_lists.items():
        new = new_lists[name]
        for index in range(old_count):
            if old[index] is not None:
                new[index].assign(old[index])
    in_new_lists = {id(v) for lst in new_lists.values() for v in lst if v is not None}
    in_old_lists = {id(v) for lst in old_lists.values() for v in lst if v is not None}
    target_others = iter([v for v in target._variables if id(v) not in in_old_lists])
    variables = [
        v if id(v) in in_new_lists else next(target_others) for v in scratch._variables
    ]
    for name, new in new_lists.items():
        object.__setattr__(target, name, new)
    target._variables = variables
    target._trainable_variables = scratch._trainable_variables[:]
    target._trainable_variables_indices = dict(scratch._trainable_variables_indices)


@contextlib.contextmanager
def optimizer_state_in_order(optimizer, variables):
    """Within: a built `optimizer` lists its state (`optimizer.variables`,
    what Keras saves, by position) in the order a build over `variables`
    would have made it. `variables` are the optimizer's own, in the order
    the model lists them when loaded; nothing but that list's order changes.

    Keras loads saved optimizer state by position into an optimizer built
    over the loaded model's variables. An optimizer extended for variables
    created after the first batch holds them last: saved as it is, a grown
    layer's moments loaded into its neighbour's (silently, where the shapes
    agree). Keras's optimizers build their state variable by variable, so
    the slots of the i-th variable take the place of those of the variable
    now at that index.
    """
    layers = [optimizer, getattr(optimizer, "inner_optimizer", None)]
    saved = [(one, one._variables) for one in layers if one is not None and one.built]
    try:
        for one, current in saved:
            reordered = _variables_in_order(one, variables)
            if reordered is not None:
                one._variables = reordered
        yield
    finally:
        for one, current in saved:
            one._variables = current


def _variables_in_order(optimizer, variables):
    """`optimizer._variables` with the per-variable slots permuted to the
    order of `variables`, or None when they are not its own or it holds a
    variable without slots (`overwrite_with_gradient`: positions shift)."""
    known = optimizer_trainable_variables(optimizer)
    position = {id(v): index for index, v in enumerate(known)}
    sources = [position.get(id(v)) for v in variables]
    if (len(sources) != len(known) or None in sources or len(set(sources)) != len(sources)
            or sources == list(range(len(known)))):
        return None
    lists = optimizer_slot_lists(optimizer)
    if any(item is None for slots in lists.values() for item in slots):
        return None
    slot_of = {id(item): (slots, index) for slots in lists.values()
               for index, item in enumerate(slots)}
    reordered = []
    for variable in optimizer._variables:
        if id(variable) in slot_of:
            slots, index = slot_of[id(variable)]
            variable = slots[sources[index]]
        reordered.append(variable)
    return reordered


def optimizer_knows(optimizer, variable):
    """Whether a built `optimizer` holds state for `variable` (looked up as
    Keras looks it up: a distributed variable by its container)."""
    return optimizer._var_key(variable) in optimizer._trainable_variables_indices


def hand_over_optimizer_slot(optimizer, old, new):
    """Make `optimizer` apply to `new` what it applied to `old`: `new` takes
    `old`'s index, so its state (moments, EMA, accumulated gradients, every
    per-variable list) becomes `new`'s, and `old` leaves the optimizer.

    A LossScaleOptimizer keeps the per-variable state in its inner optimizer
    and an index of its own: both are handed over.
    """
    for one in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if one is None or not one.built:
            continue
        indices = one._trainable_variables_indices
        index = indices.pop(one._var_key(old))
        indices[one._var_key(new)] = index
        one._trainable_variables[index] = new


def model_strategy(model):
    """The strategy `model` was created under, or None (Keras keeps it in a
    private attribute; `model.distribute_strategy` falls back to the current
    one, which hides whether the model was built inside a scope)."""
    return getattr(model, "_distribute_strategy", None)


def symbolic_build_from_one_replica(model, iterator=None, data_batch=None):
    """Keras's `_maybe_symbolic_build`, shaping the build from one replica's
    share of the first batch.

    Keras 3 (to at least 3.15) reduces a distributed first batch with
    `strategy.reduce("MEAN", ...)`, which fails under
    MultiWorkerMirroredStrategy ("Attempt to convert a value (PerReplica...)");
    only its shapes and dtypes matter here, so one replica's values do.
    """
    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None:
        return
    if iterator is not None:
        for _, _, epoch_iterator in iterator:
            batch = next(epoch_iterator)
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            break
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)


class OneReplicaSymbolicBuild:
    """A mixin for a `keras.Model` subclass of ours whose symbolic build
    takes one replica's batch (see `symbolic_build_from_one_replica`).

    Overriding Keras's private `_maybe_symbolic_build` is private access, so
    it lives here, in the one module allowed it.
    """

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        symbolic_build_from_one_replica(self, iterator, data_batch)


def reduces_across_workers(strategy):
    """Whether Keras reduces step outputs with a collective across workers
    (MultiWorkerMirroredStrategy with more than one worker)."""
    extended = getattr(strategy, "extended", None)
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and bool(
        getattr(extended, "_in_multi_worker_mode", lambda: False)()
    )


def all_layers(layer):
    """`layer` and every layer inside it, each once."""
    return layer._flatten_layers(include_self=True, recursive=True)


def sub_layers(layer, recursive=True):
    """The layers inside `layer` (all of them, or only its direct ones)."""
    return layer._flatten_layers(include_self=False, recursive=recursive)


def clear_own_losses(layer):
    """Forget the losses `layer` itself added (`add_loss`), as Keras does at
    the outermost call of a model (`layers/added_loss.py`: a graph's loss
    node replaces what its previous run added); nothing in a stateless
    scope, whose losses are the scope's (a recomputed segment: the executor
    adds them to the layer afterwards). No public API clears them."""
    from keras.src import backend

    if backend.in_stateless_scope():
        return
    layer._losses.clear()
    layer._loss_ids.clear()


def own_losses(layer):
    """The losses `layer` itself added (`add_loss`), not its sub-layers'
    (`training/step_losses.py`). No public API tells them apart."""
    return layer._get_own_losses()


def own_variables(layer):
    """The variables `layer` made itself (`add_weight`), not its
    sub-layers': what `layer.weights` adds to theirs, without walking them
    (comparing the blocks of a model reads every layer's)."""
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def variable_strategy(variable):
    """The tf.distribute strategy that created `variable` (a Keras or a TF
    variable), or None for the default one."""
    return getattr(getattr(variable, "value", variable), "_distribute_strategy", None)


def is_default_strategy(strategy):
    """Whether `strategy` is TensorFlow's default one (no `strategy.scope()`
    active), under which variables have no strategy (`variable_strategy`)."""
    from tensorflow.python.distribute import distribute_lib

    return strategy is distribute_lib._get_default_strategy()


def stored_value(variable):
    """A read of `variable`'s stored value (its own dtype, whatever autocast
    scope is active): `variable.value` would already be cast to a mixed
    precision compute dtype. Gradients reach the variable through the read."""
    return tf.convert_to_tensor(variable._value)


def current_value(variable):
    """`variable`'s value as `call` would see it before any autocast: the
    value a surrounding `keras.StatelessScope` maps it to (a recomputed
    segment's weights, read once), else its stored value."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    scope = get_stateless_scope()
    if scope is not None:
        value = scope.get_current_value(variable)
        if value is not None:
            return value
    return stored_value(variable)


def stateless_scope(state_mapping, collect_losses=False):
    """A `keras.StatelessScope` mapping each variable to its value in the
    variable's own dtype.

    `StatelessScope` converts each value to `variable.dtype`, which inside
    an autocast scope (any layer call under a mixed precision policy) is
    the compute dtype: a float32 layer in a float16 model then ran on
    weights rounded to float16. The scope is made with no autocast scope
    active; reads inside it still autocast as the calling layer asks.
    """
    import keras

    previous = global_state.get_global_attribute("autocast_scope")
    global_state.set_global_attribute("autocast_scope", None)
    try:
        return keras.StatelessScope(state_mapping=state_mapping, collect_losses=collect_losses)
    finally:
        global_state.set_global_attribute("autocast_scope", previous)


def record_call(operation, args, kwargs, output_specs):
    """Record `operation(*args, **kwargs)` in a functional graph without
    calling it: its outputs are new KerasTensors shaped like `output_specs`
    (KerasTensors the graph IR kept from the trace).

    A symbolic call would run Keras's `compute_output_spec`, which for a
    layer without `compute_output_shape` traces its whole `call` in a
    scratch TensorFlow graph; the IR already knows every output shape, and
    every layer in it is built, so rebuilding needs only the node.
    """
    outputs = [
        keras_tensor_like(spec, ragged=getattr(spec, "ragged", False))
        for spec in output_specs
    ]
    KerasNode(operation, call_args=args, call_kwargs=kwargs, outputs=outputs)
    return outputs


def keras_tensor_like(spec, ragged=None):
    """A new KerasTensor with `spec`'s shape, dtype, sparse and ragged
    flags, named as Keras names one (`keras_tensor_17`).

    Keras derives that name from the class name with three regular
    expressions per tensor, two thirds of a KerasTensor's cost; a rebuilt
    model of 2,000 layers makes one per layer output. The same counter
    numbers it here.
    """
    import keras

    return keras.KerasTensor(
        spec.shape, dtype=spec.dtype, sparse=spec.sparse,
        ragged=spec.ragged if ragged is None else ragged,
        name=_naming.uniquify("keras_tensor"),
    )


def auto_layer_name_base(layer):
    """The name Keras gives `layer` when its constructor is given none,
    before its process-wide counter is appended (`Dense` -> `dense`)."""
    return _naming.to_snake_case(type(layer).__name__)


def compile_arguments(model):
    """The keyword arguments `model.compile` was last called with (Keras keeps
    them only in a private attribute), or None before `compile`."""
    config = getattr(model, "_compile_config", None)
    return None if config is None else dict(config.config)


# A `keras.Operation`'s own attributes that are Keras's bookkeeping, not
# what the operation computes (see `copied_operation`).
OPERATION_BOOKKEEPING = frozenset({
    "name", "_inbound_nodes", "_outbound_nodes", "_auto_config", "_auto_config_error_args",
    "_lock", "_remat_mode",
})


def copied_operation(operation):
    """A new `keras.Operation` (not a layer) of `operation`'s class with its
    attributes but none of its Keras nodes: the same `keras.ops` call made
    again, for another block's graph (`frontend/replay.py`). Keras's
    operations hold their arguments as plain attributes and change none of
    them once made; the attributes are shared."""
    new = object.__new__(type(operation))
    vars(new).update(vars(operation))
    new._inbound_nodes = []
    new._outbound_nodes = []
    return new


def forget_nodes(layers):
    """Drop every Keras node recorded on `layers` (layers the plugin made
    for one trace, whose symbolic calls are kept only in the graph IR)."""
    for layer in layers:
        del layer._inbound_nodes[:]
        del layer._outbound_nodes[:]


def broadcast_to_operation(shape):
    """The `keras.ops.broadcast_to` operation for a target `shape` (which may
    hold None, filled in by `BatchSizedOperation` when the graph runs)."""
    from keras.src.ops.numpy import BroadcastTo

    return BroadcastTo(shape=tuple(shape))


# -- what the trace-time idioms wrap (frontend/traced_idioms.py) --------------
# The patches themselves (what each wrapper does, thread-confined) are tracing
# behaviour and live with the tracer; only reaching the objects is access.


def traced_idiom_targets():
    """The Keras objects `frontend/traced_idioms.py` wraps while a trace runs:
    `variable` (the backend's Variable class) and `variable_initializer` (the
    name of its private method that draws the initial value), `tile` and
    `ndim` (the `ops.tile` / `ops.ndim` operation classes), `keras_tensor`,
    and `random_backend` (the module `keras.random` draws call into)."""
    from keras.src import backend
    from keras.src.backend.common.keras_tensor import KerasTensor
    from keras.src.ops.numpy import Ndim
    from keras.src.ops.numpy import Tile
    from keras.src.random import random

    return types.SimpleNamespace(
        variable=backend.Variable, variable_initializer="_initialize_with_initializer",
        tile=Tile, ndim=Ndim, keras_tensor=KerasTensor,
        random_backend=random.backend.random)


def eager_tensor_array_targets():
    """`(class, write, stack)`: TensorFlow's eager `TensorArray` implementation
    (what `tf.TensorArray` is while a trace runs `call` eagerly) and the names
    of the methods `frontend/traced_idioms.py` wraps (`frontend/tensor_arrays.py`)."""
    from tensorflow.python.ops import tensor_array_ops

    return tensor_array_ops._EagerTensorArray, "_write", "stack"


def tensor_array_state(array):
    """`(items, dtype, dynamic_size, infer_shape, element_shape)` of an eager
    TensorArray implementation: `items` is its own list of elements (None
    where unwritten), to change in place."""
    return (array._tensor_array, array._dtype, array._dynamic_size, array._infer_shape,
            array._element_shape)


def set_tensor_array_element_shape(array, shape):
    array._element_shape = shape


def tensor_array_zeros(array, index):
    """TensorFlow's zeros for an unwritten element (kept in the array, as its
    `stack` keeps them)."""
    return array._maybe_zero(index)


def tensor_size_attributes():
    """`{keras.ops operation class: {attribute: placeholder}}`: the operations
    whose size (or weights) a traced call may give as a graph tensor, where
    Keras takes a Python value (`ops.segment_sum(..., num_segments=tensor)`,
    `ops.repeat(x, tensor)`), with the value each attribute holds in a saved
    `layers.tensor_sized.TensorSizedOperation` (the tensor fills it when the
    graph runs). TensorFlow's functions under them take a tensor there.
    Also what `frontend/traced_idioms.py` wraps the `symbolic_call` of."""
    from keras.src.ops.math import SegmentMax
    from keras.src.ops.math import SegmentSum
    from keras.src.ops.math import TopK
    from keras.src.ops.nn import MultiHot
    from keras.src.ops.nn import OneHot
    from keras.src.ops.numpy import Bincount
    from keras.src.ops.numpy import Repeat

    return {
        SegmentSum: {"num_segments": None}, SegmentMax: {"num_segments": None},
        Repeat: {"repeats": None}, OneHot: {"num_classes": None},
        MultiHot: {"num_classes": 1}, Bincount: {"weights": None, "minlength": 0},
        TopK: {"k": None},
    }


@functools.lru_cache(maxsize=None)
def segment_functions():
    """`[(module, name)]` where `keras.ops.segment_sum` / `segment_max` are
    reachable as module attributes (`keras.ops`, `keras.ops.math`, Keras's
    own `keras.src.ops.math`): `frontend/traced_idioms.py` wraps them to
    see a `num_segments` given explicitly as None (an unknown dimension,
    `ops.shape(x)[0]` while tracing)."""
    from keras.src.ops import math as keras_math

    found = []  # (a tuple: cached)
    for name in ("segment_sum", "segment_max"):
        function = getattr(keras_math, name)
        for module in list(sys.modules.values()):
            module_name = getattr(module, "__name__", "") or ""
            if module_name.startswith("keras") and isinstance(module, types.ModuleType) \
                    and getattr(module, "__dict__", {}).get(name) is function:
                found.append((module, name))
    return tuple(found)


# -- TensorFlow functions on symbolic tensors (frontend/tf_functions.py) ------
# TensorFlow's type-based dispatch (`tf.experimental.dispatch_for_api`, public)
# consults its targets only for argument types registered as dispatchable,
# which only TensorFlow's internal API can do; and its lists of elementwise
# functions are private. Registering KerasTensor changes nothing by itself:
# with no target that accepts a call, TensorFlow goes on as before.


def make_dispatchable(cls):
    """Let TensorFlow's dispatch targets see arguments of type `cls`."""
    from tensorflow.python.util import dispatch

    dispatch.register_dispatchable_type(cls)


def add_fallback_dispatch(function, target):
    """Call `target(args, kwargs)` when `function` fails on its arguments
    (TensorFlow's first dispatch system, for functions its type-based one
    does not cover: `tf.einsum(equation, *inputs)` has var-positional
    inputs, which `tf.experimental.dispatch_for_api` refuses). `target`
    returns NotImplemented to let the function's own error through. Only
    `tf.__internal__` exports the dispatcher class."""
    from tensorflow.python.util import dispatch

    class _Fallback(dispatch.OpDispatcher):
        def handle(self, args, kwargs):
            result = target(args, kwargs)
            return self.NOT_SUPPORTED if result is NotImplemented else result

    _Fallback().register(function)


def tf_elementwise_functions():
    """`(unary, binary)`: TensorFlow's elementwise functions, as it lists
    them for `tf.experimental.dispatch_for_*_elementwise_apis`."""
    from tensorflow.python.util import dispatch

    return tuple(dispatch._UNARY_ELEMENTWISE_APIS), tuple(dispatch._BINARY_ELEMENTWISE_APIS)


# -- what a conversion may change on a user's model (state.py) ----------------


# Instance attributes Keras's own Layer / TensorFlow's Trackable code keeps on
# every layer while building and calling it: restoring the user's plain
# Python attributes after a conversion must leave these as Keras set them.
LAYER_BOOKKEEPING = frozenset({"built", "_called", "_path", "_parent_path", "_lock"})
TRACKABLE_PREFIX = "_self_"


def backing_variable(variable):
    """The TensorFlow variable behind a Keras variable (what a
    `tf.variable_creator_scope` sees being created)."""
    return getattr(variable, "_value", variable)


def global_seed_generator_state():
    """The state variable of Keras's global seed generator (what unseeded
    `keras.random.*` calls draw from), or None while none exists. Never
    creates one: creating it draws from Python's `random` module."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return None if generator is None else generator.state


def current_training():
    """The `training` value of the Keras call in progress (None outside one)."""
    context = global_state.get_global_attribute(_CALL_CTX)
    return None if context is None else context.get_value("training")


def variable_signature(variable):
    """`(shape tuple, dtype name, trainable)` of a Keras variable, as stored.

    The public `shape` of the TensorFlow backend's variable builds a
    `tf.TensorShape` at every read, and `dtype` consults the autocast
    scope: together about 6 microseconds a weight, which made comparing the
    blocks of a model (`replay.layer_signature`) cost a quarter of a
    conversion. The stored `_shape` (a tuple) and `_dtype` are what they
    report outside an autocast scope."""
    shape, dtype = getattr(variable, "_shape", None), getattr(variable, "_dtype", None)
    if not isinstance(shape, tuple) or not isinstance(dtype, str):
        shape, dtype = tuple(variable.shape), variable.dtype
    return shape, dtype, variable.trainable


def constructor_config(layer):
    """The arguments `layer` was constructed with, as Keras recorded them
    for its automatic `get_config` (a dict), or None where it did not
    (far cheaper than `get_config()`, which serializes every initializer)."""
    config = getattr(layer, "_auto_config", None)
    return None if config is None else dict(config.config)


def raw_container(value):
    """The builtin list, dict or set that holds `value`'s items, or None
    when `value` is not a mutable container.

    TensorFlow's tracking wrappers (which Keras puts around the attributes
    of a functional model once it has been called) are not the builtin
    containers they look like: a `_DictWrapper` is a proxy for which
    `isinstance(w, dict)` holds while `dict.clear(w)` raises TypeError, and a
    `ListWrapper` keeps its items in `_storage`, not in its `list` base.
    Keras's own TrackedList / TrackedDict / TrackedSet are real subclasses.
    Writing through the raw container with the builtin methods bypasses the
    wrappers' tracking, which would otherwise re-track every item put back.
    """
    kind = type(value)
    if kind in NEVER_CONTAINERS:  # most values: checked first, as this runs per attribute
        return None
    if kind in OWN_STORAGE:
        return value
    if isinstance(value, _tf_data_structures._DictWrapper):
        return value.__wrapped__
    if isinstance(value, _tf_data_structures.List):
        return value._storage
    if isinstance(value, (list, dict, set)):
        OWN_STORAGE.add(kind)
        return value
    NEVER_CONTAINERS.add(kind)
    return None


#: Types whose values `raw_container` found not to be containers (it learns
#: them), so that walking a model's attributes costs a set lookup per value.
NEVER_CONTAINERS = {bool, int, float, str, bytes, type(None), tuple}
#: Types whose values are their own raw container, with no wrapper
#: bookkeeping (`list`, Keras's `TrackedList`, ...; learnt likewise).
OWN_STORAGE = {list, dict, set}


_WRAPPER_BOOKKEEPING = {
    # The copy of its items a wrapper compares with to notice changes made
    # behind its back (after which saving the model fails), and its flags.
    "_DictWrapper": ("_self_last_wrapped_dict_snapshot", "_self_external_modification",
                     "_self_non_string_key"),
    "ListWrapper": ("_last_wrapped_list_snapshot", "_external_modification_value",
                    "_non_append_mutation_value"),
}


_NO_BOOKKEEPING = types.MappingProxyType({})


def wrapper_bookkeeping(container):
    """Copies of what a TensorFlow tracking wrapper records about its items
    (empty for other containers), for `restore_wrapper_bookkeeping`."""
    names = _WRAPPER_BOOKKEEPING.get(type(container).__name__)
    if names is None:
        return _NO_BOOKKEEPING  # shared: a snapshot asks for tens of thousands
    saved = {}
    for name in names:
        value = getattr(container, name, None)
        saved[name] = type(value)(value) if isinstance(value, (list, dict)) else value
    return saved


def restore_wrapper_bookkeeping(container, saved):
    for name, value in saved.items():
        value = type(value)(value) if isinstance(value, (list, dict)) else value
        if type(container).__name__ == "_DictWrapper":
            setattr(container, name, value)  # a `_self_` name: kept on the proxy
        else:
            object.__setattr__(container, name, value)


def adopt_call_signature(alias, layer):
    """Make Keras's `alias.__call__` read its arguments as `layer.__call__`
    reads them: which is the first argument, which tensors' masks fill
    `mask` / `<name>_mask`, and so what `compute_mask` is handed.

    Without it a `call(*args, **kwargs)` wrapper hands `compute_mask` the
    tuple of all positional arguments and the tuple of their masks (an
    `Attention` behind an alias then failed to validate its inputs, and an
    embedding's `not_equal(inputs, 0)` mask gained a leading dimension).
    """
    for name in ("_call_signature", "call_signature_parameters", "_call_has_training_arg",
                 "_call_has_mask_arg", "_call_context_args", "_call_has_context_arg",
                 "_allow_non_tensor_positional_args"):
        object.__setattr__(alias, name, getattr(layer, name))


def call_takes_training_argument(layer):
    """Whether Keras hands `layer.__call__`'s `training` on to its `call`
    (`_call_has_training_arg`, also what `fit` reads to call a model as
    `model(x, training=True)` or as `model(x)`)."""
    return layer._call_has_training_arg


def set_call_takes_training_argument(layer, value):
    """Set what `call_takes_training_argument` reads (a converted model
    takes it from the model it was converted from)."""
    object.__setattr__(layer, "_call_has_training_arg", value)


def stop_gradient_recording():
    """A context in which no gradient tape records (TensorFlow's own
    `tf.recompute_grad` runs its forward pass so: the tape then keeps none
    of the segment's activations)."""
    from tensorflow.python.eager import record

    return record.stop_recording()


def keras_mask(tensor):
    """The Keras mask a tensor carries (`_keras_mask`), or None."""
    from keras.src import backend

    return backend.get_keras_mask(tensor) if tensor is not None else None


def global_seed_variables():
    """The state of Keras's global seed generator (what `keras.random`
    draws from without a `seed`), if one was made: [] otherwise."""
    state = global_seed_generator_state()
    return [] if state is None else [state]


def in_shape_inference():
    """Whether Keras is only working out output shapes (its
    `compute_output_spec`, a model's symbolic build): nothing computed here
    is ever run."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


# -- small reads of Keras's private attributes, each named for what it is -------------


def output_structure(model):
    """The nest a functional model's outputs are packed into."""
    return model._outputs_struct


def compile_config(model):
    """The object Keras keeps for `model`'s last `compile` call (a new one at
    each call), or None before `compile`."""
    return getattr(model, "_compile_config", None)


def dataset_strategy(dataset):
    """The strategy a distributed dataset was made by, or None."""
    return getattr(dataset, "_strategy", None)


def is_graph_model(model):
    """Whether `model` is a graph of layers (a functional or sequential model
    built on inputs), not a subclassed one."""
    return hasattr(model, "_nodes_by_depth")


# Modules of model code that ships inside Keras, written with its layers as
# a user's code is (ConvNeXt's `LayerScale`); the rest of Keras is its library.
KERAS_MODEL_CODE_MODULES = ("keras.src.applications.",)


def is_keras_model_code(module):
    """Whether `module` (a `__module__` string) is model code shipped inside
    Keras rather than Keras's layer library."""
    return module.startswith(KERAS_MODEL_CODE_MODULES)


def masks_keras_would_pass(layer, args, kwargs):
    """The mask arguments `layer.__call__(*args, **kwargs)` adds before it
    runs `call` (Keras 3.15's `Layer.__call__`, step 6): `mask` from the
    Keras masks of the one tensor argument when `call` takes `mask`, or
    `<name>_mask` for each tensor argument `<name>` when there are several;
    only those the caller left None. Returns `{argument: masks}` to add.

    Expand calls a layer's `call` directly, not through `__call__`, and
    must hand it the masks `__call__` would have.
    """
    from keras import tree
    from keras.src.layers.layer import CallSpec

    import numpy as np
    import keras

    # `__call__` converts arrays to tensors before it reads the arguments
    # (a graph layer's `(x, self.edges)`), and such tensors carry no mask:
    # stand-ins of their specs keep a nest mixing them with KerasTensors,
    # which Keras refuses, as Keras reads it.
    args, kwargs = tree.map_structure(
        lambda leaf: keras.KerasTensor(leaf.shape, dtype=leaf.dtype.name)
        if isinstance(leaf, np.ndarray) else leaf, (args, dict(kwargs)))
    call_spec = CallSpec(layer._call_signature, layer._call_context_args, args, kwargs)
    added = {}
    tensors = call_spec.tensor_arguments_dict
    if len(tensors) == 1:
        if "mask" in call_spec.argument_names and call_spec.arguments_dict["mask"] is None:
            only = next(iter(tensors.values()))
            added["mask"] = tree.map_structure(keras_mask, only)
    elif len(tensors) > 1:
        for name, value in tensors.items():
            mask_name = f"{name}_mask"
            if mask_name in call_spec.argument_names and call_spec.arguments_dict[mask_name] is None:
                added[mask_name] = tree.map_structure(keras_mask, value)
    return added


#: Where Keras defines its `keras.ops` operation classes (what a saved
#: `BatchSizedOperation` may hold; Keras saves them by this module).
KERAS_OPERATION_MODULES = ("keras.src.ops",)
#: Where a saved `keras.random.SeedGenerator` says it is from.
SEED_GENERATOR_MODULES = ("keras.random", "keras.src.random")


def saving_to_hdf5():
    """Whether Keras's legacy HDF5 writer (`model.save("m.h5")`,
    `keras.saving.save_model(model, "m.h5")`) is on the stack: it reads a
    model's config under its own names, which `load_model` cannot resolve
    for the plugin's registered classes."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_code.co_name == "save_model_to_hdf5"
                and frame.f_globals.get("__name__", "").startswith("keras.src.legacy.saving")):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def op_callback(callback):
    """Within: `callback(op_type, inputs, attrs, outputs, op_name=None,
    graph=None)` is called after every TensorFlow op this thread runs
    eagerly (and every op it adds to a graph, with `graph` set).

    Why private: nothing public observes a variable being written
    (`tf.Variable.assign` and Keras's `Variable.assign` have no hook, and
    patching them would reach every thread). TensorFlow keeps op callbacks
    in its eager context's thread-local data, so other threads run as before.
    """
    from tensorflow.python.framework import op_callbacks

    op_callbacks.add_op_callback(callback)
    try:
        yield
    finally:
        op_callbacks.remove_op_callback(callback)


def print_msg(message):
    """Print as Keras's progress bar does (`io_utils.print_msg`: to stdout,
    or to absl logging when interactive logging is off)."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)


@functools.lru_cache(maxsize=None)
def layer_bookkeeping_attributes():
    """The instance attributes every Keras layer has (`_layers`, `_tracked`,
    node lists, ...): Keras's, never a user's attribute."""
    import keras

    return frozenset(vars(keras.layers.Layer(name="kip_bare"))) | {"_tracked"}


# -- stateful random draws replayed between two runs (frontend/verify.py) ----
# `tf.random.normal(shape)` with no seed generator (a VAE's sampling layer
# written with TensorFlow) draws from a stateful kernel: two runs of the same
# model see other numbers, and no public API replays them. TensorFlow's
# public functions call its generated ops by module attribute (`random_ops`
# calls `gen_random_ops.random_standard_normal`, `tf.random.Generator`
# calls `gen_stateful_random_ops.stateful_standard_normal_v2`), so putting a
# recorder in their place covers every public spelling. On other threads, in
# graph mode and outside the context they draw as they always do; Keras's
# own `keras.random` uses stateless ops, untouched.
_STATEFUL_DRAW_OPS = {
    "tensorflow.python.ops.gen_random_ops": (
        "random_standard_normal", "random_uniform", "random_uniform_int", "truncated_normal",
        "parameterized_truncated_normal", "random_gamma", "random_poisson_v2", "multinomial",
        "random_shuffle"),
    "tensorflow.python.ops.gen_stateful_random_ops": (
        "stateful_standard_normal_v2", "stateful_uniform", "stateful_uniform_int",
        "stateful_uniform_full_int", "stateful_truncated_normal", "stateful_random_binomial"),
}
_draws_state = threading.local()
_draws_lock = threading.Lock()
_draws_users = [0]
_draws_patches = []  # (module, name, original)


class DrawTape:
    """The stateful random draws of the run being recorded, handed out in
    the same order to the run being replayed (`record()` / `replay()`
    before each run). A replayed draw that is not the recorded one (another
    op or shape) draws afresh and is counted in `mismatches`."""

    def __init__(self):
        self.mode = None
        self.draws = []  # (op name, argument signature, value)
        self.position = 0
        self.mismatches = 0
        self.drew = False  # whether a TensorFlow kernel drew while taped

    def record(self):
        self.mode, self.draws, self.mismatches = "record", [], 0

    def replay(self):
        self.mode, self.position = "replay", 0

    def stop(self):
        self.mode = None

    @property
    def recorded(self):
        return len(self.draws)

    def draw(self, name, original, args, kwargs):
        signature = _draw_signature(args, kwargs)
        if self.mode == "record":
            self.drew = True
            value = original(*args, **kwargs)
            self.draws.append((name, signature, value))
            return value
        if self.mode == "replay" and self.position < len(self.draws):
            recorded_name, recorded_signature, value = self.draws[self.position]
            self.position += 1
            if (recorded_name, recorded_signature) == (name, signature):
                return value
        if self.mode == "replay":
            self.mismatches += 1
        self.drew = True
        return original(*args, **kwargs)


def _draw_signature(args, kwargs):
    """What tells one draw from another: the ops' arguments, tensors by
    shape and dtype, small integer tensors (a shape) by value; seeds left
    out (an unseeded draw gets a new op seed each time)."""
    import numpy as np

    def part(value):
        if tf.is_tensor(value) and not isinstance(value, tf.Variable):
            if value.dtype.is_integer and value.shape.rank is not None and value.shape.rank <= 1:
                try:
                    return ("int", tuple(np.asarray(value).reshape(-1).tolist()))
                except Exception:  # a symbolic tensor: graph mode, not taped
                    return ("tensor", str(value.dtype))
            return ("tensor", tuple(value.shape), str(value.dtype))
        if isinstance(value, (list, tuple)):
            return tuple(part(v) for v in value)
        return repr(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__

    kept = {k: v for k, v in kwargs.items() if k not in ("seed", "seed2", "name")}
    return tuple(part(a) for a in args), tuple(sorted((k, part(v)) for k, v in kept.items()))


def _taped(name, original):
    def draw(*args, **kwargs):
        tape = getattr(_draws_state, "tape", None)
        if tape is None or tape.mode is None or not tf.executing_eagerly():
            return original(*args, **kwargs)
        return tape.draw(name, original, args, kwargs)

    draw.__name__ = name
    return draw


@contextlib.contextmanager
def taped_stateful_draws():
    """A `DrawTape` for TensorFlow's stateful random draws on this thread
    while the context lasts; TensorFlow's global random state (the eager
    op-seed sequence of `tf.random.set_seed`, the global `tf.random.Generator`
    when one exists) is put back as it was when the context ends, so that
    the runs made inside it leave the user's random numbers as they were.

    Example:
        >>> with taped_stateful_draws() as tape:
        ...     tape.record(); a = tf.random.normal((2,))
        ...     tape.replay(); b = tf.random.normal((2,))
        >>> bool(tf.reduce_all(a == b))
        True
    """
    import importlib

    saved = _global_random_state()
    with _draws_lock:
        if _draws_users[0] == 0:
            for module_name, names in _STATEFUL_DRAW_OPS.items():
                module = importlib.import_module(module_name)
                for name in names:
                    original = getattr(module, name, None)
                    if original is not None:
                        _draws_patches.append((module, name, original))
                        setattr(module, name, _taped(name, original))
        _draws_users[0] += 1
    outer = getattr(_draws_state, "tape", None)
    tape = _draws_state.tape = DrawTape()
    try:
        yield tape
    finally:
        _draws_state.tape = outer
        with _draws_lock:
            _draws_users[0] -= 1
            if _draws_users[0] == 0:
                while _draws_patches:
                    module, name, original = _draws_patches.pop()
                    setattr(module, name, original)
        _put_back_global_random_state(saved, tape.drew)


def _global_random_state():
    from tensorflow.python.eager import context
    from tensorflow.python.ops import stateful_random_ops

    rng = getattr(context.context(), "_rng", None)
    generator = stateful_random_ops.global_generator  # None until first asked for
    return (rng, rng.getstate() if rng is not None else None,
            generator, None if generator is None else generator.state.numpy())


def _put_back_global_random_state(saved, drew):
    """The op-seed sequence and the global generator as they were; where a
    kernel drew, TensorFlow's kernels are reset too (as `tf.random.set_seed`
    resets them): the op seeds handed out again would otherwise find the
    kernels the taped runs advanced, and draw other numbers than without
    those runs. (A kernel with an explicit op seed that drew before the
    context then restarts its sequence, as after `tf.random.set_seed`.)"""
    from tensorflow.python.eager import context

    rng, rng_state, generator, generator_state = saved
    if rng is not None:
        rng.setstate(rng_state)
    if generator is not None:
        generator.state.assign(generator_state)
    if drew:
        context.context().clear_kernel_cache()


# -- which TensorFlow function raised (frontend/failures.py) ------------------
# TensorFlow filters its own frames out of the tracebacks of its errors
# (`traceback_utils.filter_traceback`); the frame of its filter stays, and
# holds the function it called (`fn`), TensorFlow's dispatch handler, whose
# target is a variable of its closure (`dispatch_target`). No public API
# says which function an error came from.
_TF_RANDOM_MODULES = re.compile(r"tensorflow[/\\.]python[/\\.]ops[/\\.]"
                                r"(stateless_|stateful_)?random_ops(\.py)?$")


def raised_in_tf_random_function(error):
    """Whether `error` was raised inside one of TensorFlow's random
    functions (`tf.random.normal(shape=(batch, dim))` on symbolic sizes)."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        called = frame.f_locals.get("fn") if frame.f_code.co_name == "error_handler" else None
        module = _module_called(called) if callable(called) else ""
        if _TF_RANDOM_MODULES.search(frame.f_code.co_filename) or _TF_RANDOM_MODULES.search(module):
            return True
        tb = tb.tb_next
    return False


def _module_called(function):
    try:
        function = inspect.unwrap(function)
        target = inspect.getclosurevars(function).nonlocals.get("dispatch_target")
    except (ValueError, TypeError):
        return ""
    return getattr(target if callable(target) else function, "__module__", None) or ""


def loss_tracker(model):
    """The `Mean` metric Keras's own `train_step` feeds the loss to (no
    public accessor; `model.metrics` lists it without saying which it is).
    The pipelined step (`training/pipelined_step.py`) feeds it the same."""
    return model._loss_tracker


def added_loss(layer, loss):
    """Whether `layer` added `loss` (`add_loss`, or its activity
    regularizer) inside the current `keras.StatelessScope`: Keras keeps the
    ids of the losses a layer added there, and no public accessor."""
    return id(loss) in getattr(layer, "_loss_ids", ())
