"""`kip.plot_model` / `kip.model_to_dot`: a converted model drawn as its
`summary()` lists it, by node path.

Keras's `keras.utils.plot_model` names each box after the Keras layer
(`multi_head_attention_2`, a counter that differs between builds and that
no report, target or config uses) and draws a `VariableRead` as fed by the
tensor it is anchored on (an input). This draws with Keras's own
`keras.utils.model_to_dot` (its layout, edges and look) and then labels
each box as the summary names the node: its path and the class it really
calls (an alias's layer, an opaque node's layer); a node that reads no
input (a `VariableRead`, a `HeldConstant`: they take a graph tensor only
to be part of the graph) has no edge into it. A `PluginModel` is drawn as
its converted graph.

Example:
    ```python
    kip.plot_model(passed, to_file="passed.png", show_shapes=True)
    ```
"""

import html
import importlib
import os
import shutil
from dataclasses import dataclass

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.state import HeldConstant
from keras_ipu_plugin.layers.state import VariableRead
from keras_ipu_plugin.runtime.functional import graph_model
from keras_ipu_plugin.runtime.model_summary import called_layer
from keras_ipu_plugin.runtime.model_summary import node_class_name

PLOT_NEEDS = (
    "kip.plot_model needs pydot and graphviz: `pip install pydot` (or "
    "`pip install \"keras_ipu_plugin[plot]\"`) and graphviz's `dot` program on PATH "
    "(`apt-get install graphviz`, `brew install graphviz` or `conda install graphviz`)."
)

#: Extensions `plot_model` writes the dot source to (no graphviz needed).
DOT_SOURCE_EXTENSIONS = ("dot", "gv")

#: Layers that take a graph tensor only to be part of the graph, not as input.
_READ_NO_INPUT = (VariableRead, HeldConstant)


def model_to_dot(model, show_shapes=False, show_dtype=False, show_layer_names=True,
                 rankdir="TB", expand_nested=False, dpi=200, show_layer_activations=False,
                 show_trainable=False, splines="ortho"):
    """`keras.utils.model_to_dot` of `model` with each box named by its node
    path, as `model.summary()` names it (`blocks.1.att (MultiHeadAttention)`,
    not `multi_head_attention_2`), and no edge into a node that reads no
    input (a variable read). `model` is a converted model, the result of
    `apply_passes`, a `PluginModel` that has seen a batch (its converted
    graph) or any functional or Sequential model. Needs pydot only.

    The arguments are Keras's, but `show_layer_names` defaults to True (the
    paths are the point) and `expand_nested` is refused: every node is one
    box; `kip.passes.Expand` shows the inside of a block.

    Example:
        ```python
        dot = kip.model_to_dot(passed, show_shapes=True)
        dot.write("passed.svg", format="svg")
        ```
    """
    return _dot(model, "kip.model_to_dot", show_shapes=show_shapes, show_dtype=show_dtype,
                show_layer_names=show_layer_names, rankdir=rankdir,
                expand_nested=expand_nested, dpi=dpi,
                show_layer_activations=show_layer_activations,
                show_trainable=show_trainable, splines=splines)


def _dot(model, caller, expand_nested, **options):
    """`model_to_dot` for `caller` (named in errors)."""
    _import_pydot()
    model = graph_model(model, caller)
    if expand_nested:
        raise ValueError(
            f"{caller} draws each node of the graph as one box (expand_nested=True "
            "is not supported): to see inside a block, expand it first, "
            "kip.apply_passes(model, [kip.passes.Expand(\"block.path\")]).")
    if not isinstance(model, keras.Model) or not (
            isinstance(model, keras.Sequential) or _compat.is_graph_model(model)):
        raise TypeError(
            f"{caller} draws a graph of layers; `{getattr(model, 'name', model)}` is a "
            f"{type(model).__name__}, which Keras would draw as one box. Convert it first, "
            "kip.convert_to_functional(model, x), or wrap it in kip.PluginModel and call it "
            "once.")
    dot = keras.utils.model_to_dot(model, expand_nested=False, **options)
    boxes = _boxes(model)
    shown = {key: options[key] for key in (
        "show_layer_names", "show_shapes", "show_dtype", "show_layer_activations",
        "show_trainable")}
    for dot_node in dot.get_nodes():
        box = boxes.get(dot_node.get_name())
        if box is not None:
            dot_node.set("label", _label(box, **shown))
    # Keras draws the tensor a read is anchored on as its input.
    no_input = {key for key, box in boxes.items() if isinstance(box.operation, _READ_NO_INPUT)}
    for edge in list(dot.get_edges()):
        if edge.get_destination() in no_input:
            dot.del_edge(edge.get_source(), edge.get_destination())
    return dot


def plot_model(model, to_file="model.png", show_shapes=False, show_dtype=False,
               show_layer_names=True, rankdir="TB", expand_nested=False, dpi=200,
               show_layer_activations=False, show_trainable=False, splines="ortho"):
    """Draw `model` to `to_file` as `keras.utils.plot_model` does, each box
    named by its node path (see `model_to_dot` for what `model` may be).

    The format is the file's extension (`.png` without one); `.dot` (or
    `.gv`) writes the graph's dot source, which needs pydot alone. Raises
    `ImportError` saying what to install where pydot or graphviz's `dot`
    program is missing. Returns the image (png, jpg, gif or svg) for a
    notebook to show where IPython is installed, as Keras does; else None.

    Example:
        ```python
        kip.plot_model(passed, to_file="passed.png", show_shapes=True)
        ```
    """
    to_file = os.fspath(to_file)
    extension = os.path.splitext(to_file)[1][1:].lower() or "png"
    source = extension in DOT_SOURCE_EXTENSIONS
    _import_pydot()
    if not source and shutil.which("dot") is None:
        raise ImportError("graphviz is not installed (no `dot` program on PATH). " + PLOT_NEEDS)
    dot = _dot(model, "kip.plot_model", show_shapes=show_shapes, show_dtype=show_dtype,
               show_layer_names=show_layer_names, rankdir=rankdir,
               expand_nested=expand_nested, dpi=dpi,
               show_layer_activations=show_layer_activations,
               show_trainable=show_trainable, splines=splines)
    dot.write(to_file, format="raw" if source else extension)
    try:
        from IPython import display
    except ImportError:
        return None
    if extension == "svg":
        return display.SVG(filename=to_file)
    if extension in ("png", "jpg", "jpeg", "gif"):
        return display.Image(filename=to_file)
    return None


def _import_pydot():
    try:
        return importlib.import_module("pydot")
    except ImportError:
        raise ImportError("pydot is not installed. " + PLOT_NEEDS) from None


@dataclass
class _Box:
    """What one box of the plot shows."""

    paths: list
    operation: object
    inputs: list   # KerasTensors (shape, dtype) the node reads
    outputs: list  # and those it returns


def _boxes(model):
    """`{dot node name: _Box}` of `model`'s operations: the graph's nodes
    by path where the model has a graph, else its layers by the paths the
    model records (`kip_layer_paths`, a loaded model) or their names."""
    boxes = {}
    for tensor in keras.tree.flatten(model.inputs):
        history = _compat.keras_history(tensor)
        if history is not None:
            boxes[str(id(history[0]))] = _Box([history[0].name], history[0], [], [tensor])
    graph = getattr(model, "kip_graph", None)
    if graph is not None:
        for node in graph.nodes:
            key = str(id(node.operation))
            if key in boxes:  # a layer called at several paths is one box, as in Keras
                boxes[key].paths.append(node.name)
                continue
            reads = [] if isinstance(node.operation, _READ_NO_INPUT) else node.input_values
            boxes[key] = _Box([node.name], node.operation, [value.spec for value in reads],
                              [value.spec for value in node.outputs])
        return boxes
    paths = {name: path for path, name in getattr(model, "kip_layer_paths", {}).items()}
    for layer in model.layers:
        key = str(id(layer))
        if key in boxes:
            continue
        try:  # as Keras: a layer called more than once has no one input
            inputs = [] if isinstance(layer, _READ_NO_INPUT) else keras.tree.flatten(layer.input)
            outputs = keras.tree.flatten(layer.output)
        except (ValueError, AttributeError):
            inputs = outputs = None
        boxes[key] = _Box([paths.get(layer.name, layer.name)], layer, inputs, outputs)
    return boxes


def _label(box, show_layer_names, show_shapes, show_dtype, show_layer_activations,
           show_trainable):
    """The box's HTML label, laid out as Keras lays out its own."""
    layer = called_layer(box.operation)
    class_name = html.escape(node_class_name(box.operation, layer))
    cells = []
    if show_shapes:
        if not isinstance(box.operation, keras.layers.InputLayer) and box.inputs != []:
            cells.append(_cell("Input shape", _shapes(box.inputs)))
        cells.append(_cell("Output shape", _shapes(box.outputs)))
    if show_dtype:
        dtypes = None if box.outputs is None else [t.dtype for t in box.outputs]
        cells.append(_cell("Output dtype", _one_or_list(dtypes)))
    if show_trainable and getattr(layer, "weights", None):
        color, text = ("forestgreen", "Trainable") if layer.trainable else (
            "firebrick", "Non-trainable")
        cells.append(f'<td bgcolor="{color}"><font point-size="14" color="white">'
                     f"<b>{text}</b></font></td>")
    span = max(1, len(cells))
    title = (f"<b>{html.escape(', '.join(box.paths))}</b> ({class_name})"
             if show_layer_names else f"<b>{class_name}</b>")
    rows = [f'<tr><td colspan="{span}" bgcolor="black"><font point-size="16" '
            f'color="white">{title}</font></td></tr>']
    activation = getattr(layer, "activation", None)
    if show_layer_activations and activation is not None:
        name = getattr(activation, "name", None) or getattr(activation, "__name__", activation)
        rows.append(f'<tr><td bgcolor="white" colspan="{span}"><font point-size="14">'
                    f"Activation: <b>{html.escape(str(name))}</b></font></td></tr>")
    if cells:
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return ('<<table border="0" cellborder="1" bgcolor="black" cellpadding="10">'
            + "".join(rows) + "</table>>")


def _cell(what, text):
    return (f'<td bgcolor="white"><font point-size="14">{what}: '
            f"<b>{html.escape(text)}</b></font></td>")


def _shapes(tensors):
    return _one_or_list(None if tensors is None else [tuple(t.shape) for t in tensors])


def _one_or_list(items):
    if items is None:
        return "?"
    return str(items[0]) if len(items) == 1 else str(list(items))


__all__ = ["DOT_SOURCE_EXTENSIONS", "PLOT_NEEDS", "model_to_dot", "plot_model"]
