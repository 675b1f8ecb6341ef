"""`model.summary()` of a converted or passed model, by node path.

Keras's summary lists the functional model's Keras layers: after Expand
that shows `block_2.conv1 (LayerAlias)` beside `conv1 (Conv2D)`, the
alias's class rather than the layer it calls, and Keras's auto-names
rather than the paths the report, targets and configs use. This summary
lists the graph's nodes instead: each node's path with the class of the
layer it really calls (an alias's layer, an opaque node's layer), its
output shapes and its parameters, counted once per layer; then Keras's
totals.

Example:
    ```python
    passed.summary()
    # -> Model: "my_model"
    # -> ┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━┳━━━━━━━━━┓
    # -> ┃ Node (class)                    ┃ Output shape ┃ Param # ┃
    # -> │ input_layer (InputLayer)        │ (None, 8)    │       0 │
    # -> │ block.dense (Dense)             │ (None, 32)   │   1,056 │ ...
    ```
"""

import keras
import numpy as np
import tensorflow as tf
from rich.table import Table

from keras_ipu_plugin import _compat
from keras_ipu_plugin.report import render


def summary_text(model, graph, show_trainable=False):
    """The summary of `model` (a `KipFunctional`) from its `graph`."""
    table = Table(title=f'Model: "{model.name}"', title_justify="left")
    table.add_column("Node (class)")
    table.add_column("Output shape")
    table.add_column("Param #", justify="right")
    if show_trainable:
        table.add_column("Trainable")
    for tensor in keras.tree.flatten(model.inputs):
        history = _compat.keras_history(tensor)
        name = history[0].name if history is not None else tensor.name
        row = [f"{name} (InputLayer)", str(tuple(tensor.shape)), "0"]
        table.add_row(*(row + (["-"] if show_trainable else [])))
    counted = set()
    for node in graph.nodes:
        layer = called_layer(node.operation)
        params = "0"
        if isinstance(layer, keras.layers.Layer):
            if id(layer) in counted:
                params = "(shared)"
            else:
                counted.add(id(layer))
                params = f"{_count(layer.weights):,}"
        row = [f"{node.name} ({node_class_name(node.operation, layer)})",
               ", ".join(str(tuple(value.spec.shape)) for value in node.outputs), params]
        if show_trainable:
            row.append("Y" if getattr(layer, "trainable", False) else "-")
        table.add_row(*row)
    trainable, frozen = model.trainable_weights, model.non_trainable_weights
    lines = [
        f" Total params: {_count(model.weights):,} ({_size(model.weights)})",
        f" Trainable params: {_count(trainable):,} ({_size(trainable)})",
        f" Non-trainable params: {_count(frozen):,} ({_size(frozen)})",
    ]
    return render(table) + "\n".join(lines) + "\n"


def called_layer(operation):
    """The layer a node really calls: an alias's or an opaque node's own."""
    for attribute in ("aliased_layer", "layer"):
        inner = getattr(operation, attribute, None)
        if isinstance(inner, keras.layers.Layer) and type(operation).__module__.startswith(
                "keras_ipu_plugin"):
            return inner
    return operation


def node_class_name(operation, layer):
    """The class a node shows: that of `layer`, the one it really calls
    (`called_layer`), marked "kept whole" for an opaque node."""
    name = type(layer).__name__
    if type(operation).__name__ == "OpaqueLayer":
        return f"{name}, kept whole"
    return name


def _unique(weights):
    seen, found = set(), []
    for weight in weights:
        if id(weight) not in seen:
            seen.add(id(weight))
            found.append(weight)
    return found


def _count(weights):
    return int(sum(np.prod(w.shape, dtype=np.int64) for w in _unique(weights)))


def _size(weights):
    size = float(sum(np.prod(w.shape, dtype=np.int64) * tf.as_dtype(w.dtype).size
                     for w in _unique(weights)))
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} GB"


__all__ = ["called_layer", "node_class_name", "summary_text"]
