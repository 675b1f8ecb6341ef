"""The calls a train step makes, and one conversion per kind of call.

A train step calls its model (and sub-models: a GAN's generator and
discriminator) on whatever it builds from the batch: `self(x)`, but also
`self([source, target[:, :-1]])` from a dict batch, or `self(x, mask=m)`.
What the plugin converts is therefore a *call*: the callee, the structure
of its arguments and the shapes of their tensors. `CallArguments` normalises
one call against the callee's `call` signature; `CallSignature` is what a
conversion is keyed by; `convert_call` makes a `CallConversion` from concrete
arguments, and `CallConversion` runs the converted graph for later calls of
the same kind.

Shapes follow the data: a conversion made for 32x32 images does not serve a
call on 48x48 ones, which gets its own conversion (the same layers and
variables, another graph). A dimension that is unknown where the step is
traced (a padded batch of varying length) is kept unknown in the graph.

Example:
    ```python
    call = CallArguments.of(model, (x,), {"training": True})
    converted = convert_call(model, call, verify=True)   # a KipFunctional
    call.signature().accepts(CallArguments.of(model, (x,), {}).signature())
    # -> True
    ```
"""

import functools
import inspect
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.frontend import inputs as inputs_lib
from keras_ipu_plugin.frontend.convert import Converter
from keras_ipu_plugin.frontend.convert import as_tensors
from keras_ipu_plugin.layers.user_code import takes_training


@dataclass(frozen=True)
class TensorSlot:
    """A tensor argument in a signature: its shape without the batch
    dimension (None where unknown) and its dtype."""

    shape: tuple
    dtype: str

    def accepts(self, other):
        """Whether a graph traced for `self` serves a tensor like `other`."""
        if len(self.shape) != len(other.shape):
            return False
        return all(mine is None or mine == theirs for mine, theirs in zip(self.shape, other.shape))


def is_tensor(value):
    return isinstance(value, (np.ndarray, keras.KerasTensor)) or tf.is_tensor(value)


def _slot(value):
    shape = tuple(None if d is None else int(d) for d in tuple(value.shape)[1:])
    return TensorSlot(shape, keras.backend.standardize_dtype(value.dtype))


class CallArguments:
    """One call `callee(*args, **kwargs)`, normalised: `inputs` (the first
    argument of `call`), `training`, and the other arguments by name
    (`mask`, flags), without those left at a None default."""

    def __init__(self, inputs, training=None, others=None):
        self.inputs = inputs
        self.training = training
        self.others = dict(others or {})

    @classmethod
    def of(cls, callee, args, kwargs):
        """Bind `args` / `kwargs` to `callee.call`'s parameters, as Keras
        would (a call `call` does not accept raises the same TypeError)."""
        signature = _call_signature(type(callee))
        kwargs = dict(kwargs)
        training = kwargs.pop("training", None)
        if takes_training(type(callee).call) and training is not None:
            kwargs["training"] = training  # else Keras keeps it in the context
        bound = signature.bind(None, *args, **kwargs)  # None stands for `self`
        names = list(signature.parameters)
        arguments = dict(bound.arguments)
        arguments.pop(names[0])
        if len(names) < 2:
            raise TypeError(f"`{type(callee).__name__}.call` takes no inputs.")
        first = names[1]
        if first not in arguments:
            raise TypeError(f"`{callee.name}` was called without its `{first}` argument.")
        inputs = arguments.pop(first)
        training = arguments.pop("training", training)
        for name, parameter in signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
                arguments.update(arguments.pop(name))
            elif parameter.kind is inspect.Parameter.VAR_POSITIONAL and name in arguments:
                if arguments[name]:
                    raise TypeError(
                        f"`{callee.name}` was called with extra positional arguments; "
                        "the plugin converts calls whose arguments have names."
                    )
                arguments.pop(name)
        defaults = {
            name: parameter.default for name, parameter in signature.parameters.items()
        }
        others = {
            name: value for name, value in arguments.items()
            if not (value is None and defaults.get(name) is None)
        }
        return cls(inputs, training, others)

    @property
    def simple(self):
        """Only the inputs (and `training`): the call `convert_to_functional` converts."""
        return not self.others

    def tensors(self):
        """The tensors of the call, by input name (see `_named_tensors`)."""
        return _named_tensors(self.inputs, self.others)

    def signature(self):
        return CallSignature.of(self)

    def as_call(self):
        """`(args, kwargs)` to call the original with."""
        kwargs = dict(self.others)
        if self.training is not None:
            kwargs["training"] = self.training
        return (self.inputs,), kwargs

    def is_symbolic(self):
        return any(isinstance(leaf, keras.KerasTensor) for leaf in self._leaves())

    def is_concrete(self):
        return all(
            not is_tensor(leaf) or isinstance(leaf, np.ndarray) or hasattr(leaf, "numpy")
            for leaf in self._leaves()
        ) and not self.is_symbolic()

    def _leaves(self):
        return keras.tree.flatten((self.inputs, self.others))


@functools.lru_cache(maxsize=None)
def _call_signature(cls):
    return inspect.signature(cls.call)


class CallSignature:
    """The structure of a call's arguments with every tensor reduced to a
    `TensorSlot`; other values (flags) are part of it as they are."""

    def __init__(self, structure):
        self.structure = structure

    @classmethod
    def of(cls, call):
        structure = keras.tree.map_structure(
            lambda leaf: _slot(leaf) if is_tensor(leaf) else leaf,
            (call.inputs, call.others),
        )
        return cls(structure)

    def accepts(self, other):
        try:
            keras.tree.assert_same_structure(self.structure, other.structure)
        except (ValueError, TypeError):
            return False
        for mine, theirs in zip(keras.tree.flatten(self.structure), keras.tree.flatten(other.structure)):
            if isinstance(mine, TensorSlot) != isinstance(theirs, TensorSlot):
                return False
            if isinstance(mine, TensorSlot):
                if not mine.accepts(theirs):
                    return False
            elif not _same_value(mine, theirs):
                return False
        return True

    def describe(self):
        def one(leaf):
            if isinstance(leaf, TensorSlot):
                return f"({', '.join('?' if d is None else str(d) for d in (None,) + leaf.shape)}) {leaf.dtype}"
            return repr(leaf)

        inputs, others = self.structure
        parts = [", ".join(one(leaf) for leaf in keras.tree.flatten(inputs))]
        parts += [f"{name}=" + ", ".join(one(leaf) for leaf in keras.tree.flatten(value))
                  for name, value in others.items()]
        return "; ".join(parts)

    def specs(self, example):
        """`InputSpec`s for the graph: named as `example.tensors()`, shaped
        as this signature (None where unknown), with the example's dtypes."""
        named = _named_tensors(*self.structure, is_leaf=lambda leaf: isinstance(leaf, TensorSlot))
        examples = example.tensors()
        return {
            name: inputs_lib.InputSpec(
                name=name, shape=slot.shape, dtype=inputs_lib.input_specs(examples[name]).dtype
            )
            for name, slot in named.items()
        }


def _same_value(a, b):
    try:
        return bool(a == b)
    except Exception:  # values without a plain equality: the same object only
        return a is b


def _named_tensors(inputs, others, is_leaf=is_tensor):
    """`{name: tensor}` for the tensors of a call (or the `TensorSlot`s of a
    signature): the inputs' leaves named as `convert_to_functional` names
    them (dict keys, `input_<i>`), the other arguments' by their argument
    name (`mask`, `mask_1`, ...)."""
    named = {}
    for path, leaf in keras.tree.flatten_with_path(inputs):
        if is_leaf(leaf):
            named[inputs_lib.input_name(path)] = leaf
    for argument, value in others.items():
        for path, leaf in keras.tree.flatten_with_path(value):
            if is_leaf(leaf):
                named["_".join([argument] + [str(p) for p in path])] = leaf
    return named


class CallConversion:
    """The converted (and passed) graph of `callee` for calls like `example`.

    A simple call's graph takes the inputs as `convert_to_functional`'s
    does; a call with other tensor arguments (`mask=`) takes all its tensors
    by name, and the arguments that are not tensors are fixed in the graph.
    """

    def __init__(self, callee, signature, model, example, graph_model):
        self.callee = callee
        self.signature = signature
        self.model = model  # what runs: the converted model after the passes
        self.example = example  # concrete CallArguments, kept for rebuilds
        self.graph_model = graph_model  # the converted model before the passes
        self.simple = example.simple

    def __call__(self, call):
        if self.simple:
            return self.model(call.inputs, training=call.training)
        return self.model(call.tensors(), training=call.training)


def convert_call(callee, call, *, verify=True, signature=None, static_batch=False,
                 tracer=None):
    """Convert `callee` for calls like `call` (concrete arguments), tracing
    with `tracer` (a `Tracer`; the one in use by default).

    `signature` (default: the call's own) gives the shapes the graph takes:
    a signature from a traced step keeps unknown dimensions unknown.
    """
    signature = signature or call.signature()
    converter = Converter(verify=verify, static_batch=static_batch, tracer=tracer)
    if call.simple:
        x = as_tensors(call.inputs)
        specs = signature.specs(call)
        specs = keras.tree.pack_sequence_as(
            x, [specs[name] for name in _named_tensors(x, {})])
        # `(x,)`: `x` itself, even when it is a tuple of inputs (a bare tuple
        # would be read as `(x, y)`).
        return converter.convert(callee, (x,), specs=specs)
    return _convert_bound_call(callee, call, converter, signature)


def _convert_bound_call(callee, call, converter, signature):
    """A graph taking every tensor of the call by name: `callee.call`'s body
    traced with the other arguments (`mask=`) as inputs too, checked against
    the callee called the ordinary way (`Converter.convert_call`)."""
    tensors = {name: as_tensors(t) for name, t in call.tensors().items()}
    specs = signature.specs(call)
    inputs = {name: spec.keras_input() for name, spec in specs.items()}
    (traced_inputs,), kwargs = BoundCall.fill(call, inputs).as_call()
    kwargs.pop("training", None)
    return converter.convert_call(callee, BoundCall(callee, call), inputs,
                                  ((traced_inputs,), kwargs), tensors, specs)


class BoundCall(keras.Model):
    """`callee(inputs, **others)` with every tensor taken from one dict of
    named inputs (what a functional graph takes); the other arguments of the
    call are fixed. The reference a bound call's graph is checked against.

    Example:
        ```python
        bound = BoundCall(model, CallArguments.of(model, (x,), {"mask": m}))
        bound({"input": x, "mask": m})   # == model(x, mask=m)
        ```
    """

    def __init__(self, callee, call):
        super().__init__(name=f"{callee.name}_bound", dtype=callee.dtype_policy)
        self.callee = callee
        self._call_template = call

    @staticmethod
    def fill(call, tensors):
        """`call` with its tensors replaced by `tensors` (a dict by name)."""
        names = iter(_named_tensors(call.inputs, call.others))
        structure = keras.tree.map_structure(
            lambda leaf: tensors[next(names)] if is_tensor(leaf) else leaf,
            (call.inputs, call.others),
        )
        return CallArguments(structure[0], call.training, structure[1])

    def call(self, tensors, training=None):
        filled = self.fill(self._call_template, tensors)
        filled.training = training
        args, kwargs = filled.as_call()
        return self.callee(*args, **kwargs)


__all__ = [
    "CallArguments", "CallConversion", "CallSignature", "TensorSlot", "BoundCall",
    "convert_call", "is_tensor",
]
