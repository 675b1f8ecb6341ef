"""One step from the IR to Keras: `rebuild(graph)` makes the functional model.

The model calls the very same layer objects as the graph's nodes (so every
variable a pass did not replace is shared), records each node without
calling the layer where the IR already knows its output shapes, and keeps
the graph, the pinned `training` values and the pass annotations on the
model (`KipFunctional`), which runs that graph. Nodes whose outputs nothing reads but that write
state when they run (BatchNormalization in training, random layers) still
run, as in plain Keras (`_running_unread_state_writers`).
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.layers.alias import LayerAlias
from keras_ipu_plugin.layers.layer_kinds import seed_states
from keras_ipu_plugin.layers.keras_ops.random_draws import RandomDraw
from keras_ipu_plugin.layers.tf_calls import TFRandomDraw
from keras_ipu_plugin.layers.state import AfterWrites
from keras_ipu_plugin.layers.state import VariableWrite
from keras_ipu_plugin.runtime.functional import KipFunctional


def rebuild(graph, name=None):
    """A `KipFunctional` model running `graph`, with the same layers.

    Example:
        ```python
        model = rebuild(graph, name="passed")
        model.kip_graph is graph
        # -> True
        ```
    """
    inputs = keras.tree.map_structure(
        lambda spec: spec.keras_input(), graph.input_specs
    )
    tensors = {
        id(value): tensor
        for value, tensor in zip(
            keras.tree.flatten(graph.input_values), keras.tree.flatten(inputs)
        )
    }

    def resolve(leaf):
        if isinstance(leaf, Value):
            return tensors[id(leaf)]
        return leaf

    pinned, paths = {}, {}
    named = _UniqueNames(graph.nodes, reserved=[
        spec.name for spec in keras.tree.flatten(graph.input_specs)])
    for node in graph.nodes:
        operation = named.operation_for(node)
        paths[node.name] = operation.name
        args = map_leaves(resolve, node.args)
        kwargs = map_leaves(resolve, node.kwargs)
        kwargs.pop("training", None)
        if node.training in (True, False):
            kwargs["training"] = node.training
            pinned[operation.name] = node.training
        if node.made_by_pass:
            # A new layer may compute other shapes than the one it
            # replaced: let Keras work them out.
            with _compat.call_context(operation, None):
                outputs = keras.tree.flatten(operation(*args, **kwargs))
            for value, tensor in zip(node.outputs, outputs):
                value.spec = tensor
        else:
            outputs = _compat.record_call(
                operation, args, kwargs, [value.spec for value in node.outputs]
            )
        for value, tensor in zip(node.outputs, outputs):
            tensors[id(value)] = tensor
    outputs = map_leaves(resolve, graph.outputs)
    outputs = _running_unread_state_writers(graph, outputs, tensors, named)
    model = KipFunctional(
        inputs,
        outputs,
        name=name or graph.name,
        kip_pinned_training=pinned,
        kip_layer_paths=paths,
        kip_output_modes=graph.output_modes,
    )
    model.kip_graph = graph
    object.__setattr__(model, "kip_replaced", tuple(graph.replaced))
    return model


def _running_unread_state_writers(graph, outputs, tensors, named):
    """`outputs`, the first of them made to wait for the nodes whose outputs
    nothing reads but that write state when they run: BatchNormalization's
    moving statistics in training, a Dropout's or random layer's draw, a
    counter. A Keras functional model runs only the nodes its outputs depend
    on; plain Keras runs them all (a backbone's feature map the classifier
    does not read still moves its layers' statistics, and still draws from
    the seed generators, so the next draws are the same), so the rebuilt
    model runs them too, through an `AfterWrites` on its first output."""
    read = set()
    pending = [v for v in keras.tree.flatten(graph.outputs) if isinstance(v, Value)]
    while pending:
        value = pending.pop()
        if id(value) in read:
            continue
        read.add(id(value))
        producer = value.producer
        if producer is not None:
            pending.extend(producer.input_values)
            mask = getattr(value, "mask", None)
            if isinstance(mask, Value):
                pending.append(mask)
    unread = [node for node in graph.nodes
              if node.outputs and not any(id(v) in read for v in node.outputs)
              and _writes_state(node.operation)]
    if not unread:
        return outputs
    leaves = keras.tree.flatten(outputs)
    first = next((i for i, leaf in enumerate(leaves) if leaf is not None), None)
    if first is None:
        return outputs
    waits = [tensors[id(node.outputs[0])] for node in unread]
    after = AfterWrites(name=named.taken.create("after_unread_state_writers"))
    leaves[first] = after(leaves[first], waits)
    return keras.tree.pack_sequence_as(outputs, leaves)


def _writes_state(operation):
    """Whether running `operation` may write state: a layer holding
    non-trainable variables or seed generators (in it or its sub-layers),
    a random draw, a variable write."""
    if isinstance(operation, (RandomDraw, TFRandomDraw, VariableWrite)):
        return True
    if not isinstance(operation, keras.layers.Layer):
        return False
    return bool(operation.non_trainable_variables) or bool(seed_states(operation))


class _UniqueNames:
    """The Keras layer each node's layer is called as in the rebuilt model.

    A functional model needs a distinct name per layer. A layer keeps its
    own name (the user's layer object, called as it is) unless another
    layer of the model has that name already, as sub-layers of different
    blocks often do (`conv1` in every residual block); then it is called
    through a `LayerAlias` named after its node's path (`block_2.conv1`),
    the same layer object under another name (the plugin never renames the
    user's layers). The path stays the node's name in the IR, the report
    and targets whichever name the Keras model shows; `kip_layer(path)`
    finds the layer either way.

    Nodes whose path is their layer's own name (the layers `call` used
    directly) claim their names first, so a top-level `dense` keeps its
    name even when an expanded block before it holds a `dense` too. A layer
    called at several nodes is one Keras layer (one alias, at most), and
    one more alias where some of its calls returned None among their
    outputs (`LayerAlias(tensor_outputs_only=True)`, own name if free).

    `reserved`: the names of the model's inputs, which come first: a user's
    layer may validly share one (keras.io's GRN/VSN classifier has an
    `Embedding` named "education" for the input "education"), and the
    input keeps it. A `keras.ops` operation (kip's own object, made by the
    trace) whose name another holds is called as a renamed copy.
    """

    def __init__(self, nodes, reserved=()):
        self.taken = Namespace(reserved)
        self.chosen = {}  # (id(layer), tensors only) -> the layer or its alias
        self.renamed = {}  # id(operation) -> its renamed copy
        for node in nodes:
            operation = node.operation
            if isinstance(operation, keras.layers.Layer) or id(operation) in self.renamed:
                continue
            name = getattr(operation, "name", None)
            if name is None or name not in self.taken:
                self.taken.add(name)
                self.renamed[id(operation)] = operation
                continue
            # A new operation of the same config: one object per name in
            # a Keras model, and the graph's own operation is left as it is.
            config = {**operation.get_config(), "name": self.taken.create(name)}
            self.renamed[id(operation)] = type(operation).from_config(config)
        for node in nodes:
            operation = node.operation
            key = (id(operation), _tensors_only(node))
            if (isinstance(operation, keras.layers.Layer) and not key[1]
                    and (node.name == operation.name or node.made_by_pass)
                    and key not in self.chosen
                    and operation.name not in self.taken):
                self.taken.add(operation.name)
                self.chosen[key] = operation

    def operation_for(self, node):
        operation = node.operation
        if not isinstance(operation, keras.layers.Layer):
            return self.renamed[id(operation)]  # keras.ops operations: ours
        # A call that returns None among its outputs goes through an alias
        # that returns the tensors alone (a Keras node holds tensors only);
        # that alias too has the layer's own name where it is free.
        tensors_only = _tensors_only(node)
        key = (id(operation), tensors_only)
        chosen = self.chosen.get(key)
        if chosen is None:
            if not tensors_only and operation.name not in self.taken:
                self.taken.add(operation.name)
                chosen = operation
            else:
                name = operation.name if operation.name not in self.taken else node.name
                chosen = LayerAlias(operation, tensor_outputs_only=tensors_only,
                                    name=self.taken.create(name))
            self.chosen[key] = chosen
        return chosen


def _tensors_only(node):
    """Whether the call at `node` returned None among its outputs."""
    if node.output_structure is None:
        return False
    return any(leaf is None for leaf in keras.tree.flatten(node.output_structure))
