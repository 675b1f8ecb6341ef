"""Attribute paths: the names of the user's layers in a graph.

A node is named by the chain of attribute names from the model to its
layer, as torch.fx names modules by their qualified names: `stem`,
`blocks.0.dense` (lists and tuples by index, dicts by key), and the layers
of a nested functional or Sequential model by the names their code gave
them, or by their position in its `layers` where Keras named them
(`bottom_mlp.0`, as torch.fx names a Sequential's children; the layers of
a functional model passed itself keep their Keras names, as its
`summary()` shows them). Keras's own
names come from a process-wide counter (`dense_7` the second time a cell
runs); attribute paths are the same every time the same class is built, so
a target, a config or a plan copied from one run's report works in the next.

A layer reached by no attribute (made inside `call`, a module-level layer)
keeps the name its code gave it, or is named by its class and numbered in
call order where Keras named it (`concatenate`, `concatenate_1`). Keras's own bookkeeping attributes (`_layers`,
`_tracked`, ...) are never part of a path.

Example:
    >>> class Net(keras.Model):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.stem = keras.layers.Dense(4)
    ...         self.blocks = [keras.layers.Dense(4), keras.layers.Dense(4)]
    >>> paths = attribute_paths(Net())
    >>> sorted(paths.values())
    ['blocks.0', 'blocks.1', 'stem']
"""

import re

import keras

from keras_ipu_plugin import _compat

_MAX_DEPTH = 4  # containers inside containers followed
_NOT_A_NAME = re.compile(r"[^0-9A-Za-z_]")


def attribute_paths(root, keras_names=False):
    """`{id(layer): path}` of every layer inside `root`, by the shortest
    attribute path from `root` (breadth first; the first attribute holding
    a layer names it). `keras_names`: `root` is a functional or Sequential
    model given as it is (not a block inside a model), whose own layers keep
    their Keras names, as its `summary()` shows them."""
    paths = {}
    queue = [(root, "")]
    while queue:
        layer, prefix = queue.pop(0)
        for path, sub in direct_layers(layer, nested=layer is not root or not keras_names):
            if sub is root or id(sub) in paths:
                continue
            paths[id(sub)] = prefix + path
            queue.append((sub, f"{prefix}{path}."))
    return paths


def path_of(layer, paths):
    """`layer`'s path in `paths` (`attribute_paths` of its owner), else its
    `stable_name`."""
    return paths.get(id(layer), None) or stable_name(layer)


def stable_name(layer):
    """`layer`'s name where its code gave it one, else the name Keras gives
    its class without the process-wide counter (`concatenate` for
    `concatenate_14`): a layer made inside `call` is a new object with a new
    counter name each build, so the graph numbers it in call order instead,
    as it numbers `keras.ops` calls."""
    return _compat.auto_layer_name_base(layer) if _named_by_keras(layer) else layer.name


def direct_layers(layer, nested=True):
    """`[(relative path, layer)]` for the layers `layer` holds directly.

    The layers of a functional or Sequential model given as it is (not
    `nested`) keep the names their code gave them, as its `summary()` shows
    them; those Keras named are named by class (`dense`), numbered in graph
    order, as Keras's process-wide counter differs from build to build."""
    if isinstance(layer, keras.Sequential) or _compat.is_graph_model(layer):
        if not nested:  # by name; Keras's counter names by class, numbered in graph order
            return [(_clean(stable_name(sub)), sub) for sub in layer.layers]
        return [(str(index) if _named_by_keras(sub) else _clean(sub.name), sub)
                for index, sub in enumerate(layer.layers)]
    if (type(layer).__module__ or "").startswith("keras.") and not _compat.sub_layers(
            layer, recursive=False):
        # One of Keras's own layers holding none (Dense): a fact of Keras's
        # code, not the user-code rule (`user_code.py`), which counts Keras's
        # applications as user code: Keras's code
        # assigns its sub-layers as tracked attributes, so there is nothing
        # to look for among its ~60 attributes (most of what naming the
        # nodes of an expanded model cost).
        return []
    found, private = [], []
    bookkeeping = _compat.layer_bookkeeping_attributes()
    for name, value in vars(layer).items():
        if name in bookkeeping or not isinstance(value, _HOLDERS):
            continue
        if name.startswith("_"):
            if not name.startswith(_compat.TRACKABLE_PREFIX):
                private.append((name, value))
            continue
        _collect(_clean(name), value, found, 0)
    # Public attributes name a layer before private ones do.
    for name, value in private:
        _collect(_clean(name), value, found, 0)
    return found


def _named_by_keras(layer):
    """Whether `layer.name` looks like Keras's counter name for its class
    (`dense`, `dense_7`), which the next build of the same code numbers
    differently; a name the code gave (`"conv1"`) is kept."""
    base = _compat.auto_layer_name_base(layer)
    name = layer.name
    return name == base or (name.startswith(base + "_") and name[len(base) + 1:].isdigit())


_HOLDERS = (keras.layers.Layer, list, tuple, dict)  # what `_collect` looks into


def _collect(path, value, found, depth):
    if isinstance(value, keras.layers.Layer):
        found.append((path, value))
    elif depth < _MAX_DEPTH and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _collect(f"{path}.{index}", item, found, depth + 1)
    elif depth < _MAX_DEPTH and isinstance(value, dict):
        for key, item in value.items():
            _collect(f"{path}.{_clean(str(key))}", item, found, depth + 1)


def _clean(name):
    """A path part Keras accepts in a layer name (no `/`)."""
    return _NOT_A_NAME.sub("_", name) or "_"


__all__ = ["attribute_paths", "direct_layers", "path_of", "stable_name"]
