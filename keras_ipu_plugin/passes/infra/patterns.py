"""`Chain`: a target matching runs of nodes, layers and `keras.ops` calls alike.

`Chain(keras.layers.Dense, keras.ops.gelu)` matches every Dense layer whose
output is read by a `keras.ops.gelu` call and by nothing else: the run of
nodes an accelerator fuses. Each step is a layer class (subclasses match),
a layer name or node path, a `keras.ops` function or a TensorFlow function
(`tf.nn.gelu`, recorded as a `TFFunction`). In a match every node but the
first reads the one before it and no other tensor, and every node but the
last is read by the next one only, so the run computes one tensor from its
first node's inputs.

Any pass that takes targets takes a chain: `Recompute`, `Outline` and
`PipelineStages` treat each match as one unit (as an expanded block),
`Replace` replaces each match by one new layer made from its first layer.

Example:
    ```python
    chain = Chain(keras.layers.Dense, keras.ops.gelu)
    [[node.name for node in match] for match in chain.matches(graph)]
    # -> [['dense_1', 'gelu'], ['dense_3', 'gelu_1']]
    ```
"""

import functools
import re

import keras

from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.passes.infra.layer_class_names import class_named
from keras_ipu_plugin.passes.infra.layer_class_names import name_of_class
from keras_ipu_plugin.frontend.trace.attribute_paths import attribute_paths
from keras_ipu_plugin.layers.opaque import OpaqueLayer
from keras_ipu_plugin.layers.tf_calls import TFFunction
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.layers.tf_calls import public_name_of
from keras_ipu_plugin.layers.tf_calls import RECORDED
from keras_ipu_plugin.layers.tf_calls import function_at


class Chain:
    """A target: runs of nodes matching `steps` one after another (see the
    module docstring)."""

    def __init__(self, *steps):
        if len(steps) < 2:
            raise PassError(f"Chain takes two steps or more; got {len(steps)}.")
        self.steps = tuple(_step(step) for step in steps)

    def matches(self, graph):
        """`[[node, ...]]`: each run of nodes matching the chain, in graph
        order, no node in two runs."""
        outputs = {id(value) for value in keras.tree.flatten(graph.outputs)}
        aliases = [not names_a_path(graph, getattr(step, "target", None)) for step in self.steps]
        found, used = [], set()
        for node in graph.nodes:
            if id(node) in used or not self.steps[0].matches(node, aliases[0]):
                continue
            run = [node]
            for step, alias in zip(self.steps[1:], aliases[1:]):
                following = _sole_reader(run[-1], outputs)
                if following is None or id(following) in used or not step.matches(following, alias):
                    break
                run.append(following)
            if len(run) == len(self.steps):
                found.append(run)
                used.update(id(n) for n in run)
        return found

    def lead_steps(self):
        """The steps that are layer classes or names (Expand reaches those)."""
        return [step.target for step in self.steps if isinstance(step, _LayerStep)]

    def __eq__(self, other):
        return type(other) is Chain and self.steps == other.steps

    def __hash__(self):
        return hash(self.steps)

    def __repr__(self):
        return f"Chain({', '.join(map(repr, self.steps))})"

    def describe(self):
        return "chain " + " -> ".join(step.label() for step in self.steps)

    # -- configs and saving ------------------------------------------------------
    def get_config(self, owner):
        return {"chain": [step.get_config(owner) for step in self.steps]}

    @staticmethod
    def step_from_config(item, owner):
        """One step as `get_config` writes it (a name, `{"class": ...}`,
        `{"op": ...}` or `{"tf": ...}`)."""
        return _step_from_config(item, owner)

    @classmethod
    def from_config(cls, config, owner):
        if not (isinstance(config, dict) and set(config) == {"chain"}
                and isinstance(config["chain"], list)):
            raise PassError(f"{owner}: a saved chain is {{'chain': [steps]}}; got "
                            f"{short_repr(config)}.")
        return cls(*[_step_from_config(item, owner) for item in config["chain"]])


class Match:
    """One run of nodes a `Chain` matched: what the passes report it as
    (`path`, the first and last node's paths) and its first layer."""

    __slots__ = ("path", "layer")

    def __init__(self, nodes):
        self.path = f"{nodes[0].name}..{nodes[-1].name}"
        self.layer = nodes[0].operation


def names_a_path(graph, target):
    """Whether the string `target` is a path of `graph`: a node's, a block's
    Expand inlined, or a sub-layer's inside a layer not expanded (its node's
    path, then its attribute path there). A target that is a path matches
    by path only; a layer's Keras name is an alias for a target naming no
    path. Else a path copied from the report (`dense`, the attribute) would
    also match a layer Keras happened to name `dense` in this process, and
    not in the next, where Keras's counter has moved on.

    Example:
        ```python
        names_a_path(converted.kip_graph, "blocks.0.dense")
        # -> True
        ```
    """
    if not isinstance(target, str):
        return False
    for node in graph.nodes:
        if node.name == target or any(block.path == target for block in node.from_blocks):
            return True
    for node in graph.nodes:
        if node.is_layer and target.startswith(node.name + "."):
            layer = node.operation.layer if isinstance(node.operation, OpaqueLayer) else node.operation
            if target[len(node.name) + 1:] in attribute_paths(layer).values():
                return True
    return False


def _sole_reader(node, graph_outputs):
    """The node that alone reads `node`'s one output, reading nothing else;
    None if there is none such."""
    if len(node.outputs) != 1 or id(node.outputs[0]) in graph_outputs:
        return None
    value = node.outputs[0]
    readers = list(value.users)
    if len(readers) != 1 or readers[0].input_values != [value]:
        return None
    return readers[0]


# -- steps ----------------------------------------------------------------------
class _LayerStep:
    """A layer class (subclasses too) or a layer name / node path."""

    def __init__(self, target):
        self.target = target

    def matches(self, node, aliases=True):
        """`aliases`: whether a name matches a layer's Keras name too (see
        `names_a_path`)."""
        if isinstance(self.target, str):
            keras_name = getattr(node.operation, "name", None) if aliases else None
            return self.target in (node.name, keras_name)
        return isinstance(node.operation, self.target)

    def label(self):
        return repr(self.target) if isinstance(self.target, str) else self.target.__name__

    def get_config(self, owner):
        if isinstance(self.target, str):
            return self.target
        return {"class": name_of_class(self.target, owner)}

    def __eq__(self, other):
        return type(other) is _LayerStep and self.target == other.target

    def __hash__(self):
        return hash(self.target)

    def __repr__(self):
        return self.label()


class _OperationStep:
    """A `keras.ops` function (`"op"`, its name) or a TensorFlow function
    (`"tf"`, its public path)."""

    def __init__(self, kind, name):
        self.kind, self.name = kind, name

    def matches(self, node, aliases=True):  # `aliases`: for names only
        operation = node.operation
        if self.kind == "tf":
            return isinstance(operation, TFFunction) and operation.function == self.name
        return (not isinstance(operation, keras.layers.Layer)
                and type(operation).__module__.startswith("keras.")
                and _snake(type(operation).__name__) == self.name)

    def label(self):
        return f"{'keras.ops' if self.kind == 'op' else 'tf'}.{self.name}"

    def get_config(self, owner):
        return {self.kind: self.name}

    def __eq__(self, other):
        return type(other) is _OperationStep and (self.kind, self.name) == (other.kind, other.name)

    def __hash__(self):
        return hash((self.kind, self.name))

    def __repr__(self):
        return self.label()


def _step(step):
    if isinstance(step, (_LayerStep, _OperationStep)):
        return step
    if isinstance(step, str) or (isinstance(step, type) and issubclass(step, keras.layers.Layer)):
        return _LayerStep(step)
    if callable(step) and not isinstance(step, type):
        name = getattr(step, "__name__", None)
        if name and getattr(keras.ops, name, None) is step:
            return _OperationStep("op", name)
        path = public_name_of(step)
        if path is not None and path in RECORDED:
            return _OperationStep("tf", path)
        if path is not None:
            raise PassError(
                f"A chain step `tf.{path}` never matches: kip records only the TensorFlow "
                "functions of its table (keras_ipu_plugin.layers.tf_calls.RECORDED)."
            )
    raise PassError(
        f"A chain step is a layer class, a layer name, a keras.ops function or a "
        f"TensorFlow function; got {short_repr(step)}."
    )


def _step_from_config(item, owner):
    if isinstance(item, str):
        return _LayerStep(item)
    if isinstance(item, dict) and len(item) == 1:
        (kind, name), = item.items()
        if kind == "class" and isinstance(name, str):
            cls = class_named(name)
            if cls is None:
                raise PassError(f"{owner}: unknown layer class {short_repr(name)} in a chain.")
            return _LayerStep(cls)
        if kind == "op" and isinstance(name, str):
            if name not in _keras_ops_names():
                raise PassError(f"{owner}: {short_repr(name)} is not a public keras.ops "
                                "function (a chain step {'op': name}).")
            return _OperationStep("op", name)
        if kind == "tf" and isinstance(name, str):
            try:
                function_at(name, f"{owner} chain step")
            except LoadError as error:
                raise PassError(str(error)) from None
            return _OperationStep("tf", name)
    raise PassError(
        f"{owner}: a chain step is a layer name, {{'class': name}}, {{'op': keras.ops name}} "
        f"or {{'tf': TensorFlow path}}; got {short_repr(item)}."
    )


@functools.lru_cache(maxsize=None)
def _keras_ops_names():
    """The public `keras.ops` function names: what a config's `{op: name}`
    may name (looked up in this set, never as an attribute of the text)."""
    return frozenset(name for name in dir(keras.ops)
                     if not name.startswith("_") and callable(getattr(keras.ops, name)))


def _snake(name):
    """`LeakyRelu` -> `leaky_relu`: a `keras.ops` operation class's function."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


__all__ = ["Chain", "Match"]
