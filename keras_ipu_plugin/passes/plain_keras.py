"""`to_keras`: a plain Keras functional model, for files anyone can load.

A converted or passed model is a `KipFunctional`: its `.keras` file names
kip's classes, so loading it needs `import keras_ipu_plugin` (and the
user's own layer classes registered). Where every node of the graph is one
of Keras's own layers or `keras.ops` operations, or one of kip's node kinds
that Keras's classes compute exactly (a layer's weight read, a fixed tensor,
a batch-sized reshape or broadcast, a TensorFlow function with an exact
`keras.ops` form: `plain_keras_nodes.py`), which is what `Expand("all")`
leaves of most models, the same computation fits in a model of Keras's own
classes only, whose file loads with Keras alone.

The plain model's layers are copies of the graph's (made from their
configs, with their weights as they are now), each named by its node's
path (`blocks.0.dense`): a functional model needs one name per layer, and
the sub-layers of different blocks often share one (`conv1` in every
block). A layer called at several nodes is one copy called at each. Pass
annotations (recompute checkpoints, stages, outlining) say how kip runs a
graph, not what it computes, and are not kept.

Example:
    ```python
    passed = kip.apply_passes(converted, [kip.passes.Expand("all")])
    kip.to_keras(passed).save("plain.keras")   # loads without kip
    ```
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_leaves
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.layers.user_code import is_keras_module
from keras_ipu_plugin.passes.infra.manager import graph_of_model
from keras_ipu_plugin.passes.plain_keras_nodes import GraphFacts
from keras_ipu_plugin.passes.plain_keras_nodes import Masks
from keras_ipu_plugin.passes.plain_keras_nodes import checked_outputs
from keras_ipu_plugin.passes.plain_keras_nodes import keras_form
from keras_ipu_plugin.runtime.functional import graph_model


def to_keras(model):
    """A `keras.Model` of Keras's own classes computing what `model` does.

    `model` is a converted model, the result of `apply_passes`, or a
    `PluginModel` that has seen a batch. Raises `kip.PassError` naming the
    nodes whose classes are kip's or the user's and that Keras's classes
    cannot compute exactly (a layer `Expand` left whole, a `tf.*` call
    outside `plain_keras_nodes.TF_AS_KERAS_OPS`, a weight another layer
    also holds, a variable write), with why: those need
    `import keras_ipu_plugin`, and the user's classes registered, to load.

    Example:
        ```python
        plain = kip.to_keras(kip.apply_passes(converted, [kip.passes.Expand("all")]))
        plain.save("plain.keras")
        keras.models.load_model("plain.keras")  # in a process without kip
        ```
    """
    source = graph_model(model, "to_keras")
    graph = graph_of_model(source, "to_keras")
    facts = GraphFacts(graph)
    forms, foreign = {}, []
    for node in graph.nodes:
        form = keras_form(node, facts)
        if callable(form):
            forms[node.name] = form
        elif form is not None:
            foreign.append((node.name, f"{type(node.operation).__name__}: {form}"))
        else:
            foreign += [(node.name, what) for what in _classes_not_keras(node.operation)[:1]]
    if foreign:
        listing = ", ".join(f"`{name}` ({what})" for name, what in foreign[:8])
        more = f" and {len(foreign) - 8} more" if len(foreign) > 8 else ""
        raise PassError(
            f"to_keras: `{source.name}` has nodes that are not Keras's own classes: "
            f"{listing}{more}. Their file needs `import keras_ipu_plugin` (and your layer "
            "classes registered) to load; `Expand(\"all\")` turns your own layers into "
            "Keras's where their code allows, and the report says why a layer stays whole.")
    inputs = keras.tree.map_structure(lambda spec: spec.keras_input(), graph.input_specs)
    tensors = {id(value): tensor for value, tensor in zip(
        keras.tree.flatten(graph.input_values), keras.tree.flatten(inputs))}
    names = Namespace(spec.name for spec in keras.tree.flatten(graph.input_specs))
    masks = Masks(lambda path: names.create(_layer_name(path)))
    copies = {}
    named = {}  # name -> id of the operation holding it

    def resolve(leaf):
        return tensors[id(leaf)] if isinstance(leaf, Value) else leaf

    for node in graph.nodes:
        operation = node.operation
        args = map_leaves(resolve, node.args)
        kwargs = map_leaves(resolve, node.kwargs)
        if node.name in forms:
            try:
                written = forms[node.name](args, kwargs, masks)
            except PassError:
                raise
            except Exception as error:  # noqa: BLE001 - named, as every node Keras cannot hold
                raise PassError(
                    f"to_keras: `{node.name}` ({type(operation).__name__}) cannot be written "
                    f"with Keras's classes: {type(error).__name__}: {error}") from error
            outputs = checked_outputs(node, written)
            _claim_names(outputs, names, named, {id(t) for t in tensors.values()})
        else:
            if id(operation) not in copies:
                copies[id(operation)] = _copy(operation, names.create(_layer_name(node.name)))
                named[copies[id(operation)].name] = id(copies[id(operation)])
            kwargs.pop("training", None)
            if node.training in (True, False):
                kwargs["training"] = node.training
            outputs = keras.tree.flatten(copies[id(operation)](*args, **kwargs))
        for value, tensor in zip(node.outputs, outputs):
            tensors[id(value)] = tensor
    outputs = map_leaves(resolve, graph.outputs)
    return keras.Model(inputs, outputs, name=f"{source.name}_keras")


def _claim_names(outputs, names, named, made_before):
    """Give each operation a written node made (Keras names those from a
    process-wide counter: `add_1` may be a copied node's name already) a
    name no other operation of the model has, so that Keras accepts the
    model whatever ran in the process before. `made_before`: ids of the
    tensors of the nodes before (and the inputs), where the walk stops.
    `named`: name -> id of the operation holding it (a name a written node
    took in `names` for its own operation is that operation's)."""
    stack = list(outputs)
    while stack:
        tensor = stack.pop()
        if id(tensor) in made_before:
            continue
        node, _ = _compat.producing_node(tensor)
        if node is None or named.get(node.operation.name) == id(node.operation):
            continue
        operation = node.operation
        if operation.name in named:  # another operation's name
            operation.name = names.create(operation.name)
        elif operation.name not in names:
            names.create(operation.name)
        named[operation.name] = id(operation)
        stack.extend(_compat.node_input_tensors(node))


def _classes_not_keras(operation):
    """The classes a file of `operation` would name that Keras alone does
    not resolve: its own, or what its config holds (a user's regularizer,
    initializer or activation inside a Keras `Dense`)."""
    cls = type(operation)
    if not _is_keras_module(cls.__module__):
        return [f"{cls.__module__}.{cls.__qualname__}"]
    try:
        config = keras.saving.serialize_keras_object(operation)
    except Exception as error:  # noqa: BLE001 - what Keras cannot save, a file cannot hold
        return [f"{cls.__qualname__} whose config Keras cannot serialize ({error})"]
    found = []

    def visit(value):
        if isinstance(value, dict):
            module = value.get("module")
            if isinstance(module, str) and "class_name" in value and not _is_keras_module(module):
                found.append(f"{module}.{value['class_name']} in its config")
            # A function registered with Keras (keras_hub's `gelu_approximate`
            # activation) is saved as {"module": "builtins", "class_name":
            # "function", "config": "package>name"}: found only where the
            # package registering it is imported.
            registered = value.get("config")
            if value.get("class_name") == "function" and isinstance(registered, str) and (
                    ">" in registered and registered.split(">")[0] != "keras"):
                found.append(f"the registered function `{registered}` in its config")
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(config.get("config", {}))
    return found


def _is_keras_module(module):
    """Whether a class of `module` is one Keras alone resolves from a file:
    Keras's own, or a Python builtin."""
    return module == "builtins" or is_keras_module(module)


def _layer_name(path):
    return path.replace("/", "_") or "layer"


def _copy(operation, name):
    """A new `operation` of the same class and config, named `name`, with
    the same weights (a layer) now."""
    config = dict(operation.get_config(), name=name)
    copy = type(operation).from_config(config)
    if isinstance(operation, keras.layers.Layer) and operation.weights:
        build_config = operation.get_build_config()
        if build_config is not None:
            copy.build_from_config(build_config)
        if len(copy.weights) != len(operation.weights):
            raise PassError(
                f"to_keras: the copy of `{operation.name}` ({type(operation).__name__}) made "
                f"from its config has {len(copy.weights)} weights where the layer has "
                f"{len(operation.weights)}; its weights cannot be copied.")
        copy.set_weights(operation.get_weights())
    return copy


__all__ = ["to_keras"]
