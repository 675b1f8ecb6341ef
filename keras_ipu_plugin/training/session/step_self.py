"""What a train / test step runs with when it runs through the plugin: its `self`
(a stand-in of the model's class) and the losses it sees.

`self` of a train / test step that runs through the plugin.

The model's own `train_step` (or Keras's) runs with a stand-in as `self`:
an object of a subclass of the model's class, so that the step's zero-
argument `super()` calls, `isinstance` checks and the class's own methods
(a helper named `_compute_loss` included: the user's class comes before
`keras.Model` in its MRO, as for the model itself) behave as on the model.
It holds no state of its own:

- calling it (`self(x)`) runs the converted graph for that call
  (`TrainingSession.call`), and so does calling a sub-model it holds
  (`self.generator(z)`);
- optimizers come wrapped (`OptimizingFacade`), so that new variables are
  learnt;
- `losses` adds to the model's those that the converted graphs' `add_loss`
  nodes added in the step (`StepLosses`, below);
- every other attribute is the model's. With a `PluginModel`, what Keras's
  `compile` set (optimizer, compiled loss and metrics) is the wrapper's,
  the rest (layers, the attributes the model's own `compile` set) the
  wrapped model's.

Example:
    ```python
    self_ = step_self(session)
    type(model).train_step(self_, data)   # forward through the graph
    ```

The losses a training step sees: `self.losses` of the model, and of a
sub-model it calls, when the forward pass ran through converted graphs.

Plain Keras keeps a loss that `call` adds (`self.add_loss(...)`: keras.io's
VQ-VAE quantizer, a router's load-balancing loss) on the layer that added
it, so that `model.losses` and `sub_model.losses` hold it after a call, and
Keras's `compute_loss` adds it to the training loss. In a converted graph
the loss is added by the graph's own `AddedLoss` node
(`layers/state.py`), which the user's model does not hold: a step
running through the plugin would read the user's layers and miss it. So
the step's `self` and its sub-models (`step_self.py`) add to their own
`losses` what the `AddedLoss` nodes added in the conversions run for them
(or for a model inside them) on this thread, in the graph being traced
(a conversion run in another `tf.function` trace, or eagerly, is not this
step's).

The other losses (activity regularizers, weight regularizers, layers kept
whole adding their own) are on layers the user's model holds, and are read
there as Keras reads them: nothing is counted twice.

Example:
    ```python
    ran = StepLosses()
    outputs = ran.record(model, converted, converted(x))
    ran.losses(model, model.losses)   # with what converted's AddedLoss nodes added
    ```
"""

import functools
import inspect
import threading

import keras
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers.state import loss_nodes
from keras_ipu_plugin.runtime.variables import union_of_variables
from keras_ipu_plugin.training.session.new_variables import OptimizingFacade

__all__ = ["step_self", "StepSelf", "CalleeStandIn", "StepLosses"]


_RUNTIME = "_kip_session"
_SHADOWED = "_kip_shadowed"


def step_self(session):
    """A stand-in for `session.subject` as `self` of its steps."""
    cls = _step_self_class(type(session.subject))
    proxy = object.__new__(cls)
    object.__setattr__(proxy, _RUNTIME, session)
    # On the model, an instance attribute hides a method of its class of the
    # same name (`self.compute_loss = fn` in `__init__`); the stand-in has no
    # instance attributes of its own, so it looks those names up first.
    object.__setattr__(proxy, _SHADOWED, frozenset(
        name for name in vars(session.subject) if _hides_a_class_attribute(cls, name)))
    return proxy


def _hides_a_class_attribute(cls, name):
    if name.startswith("__"):
        return False
    try:
        attribute = inspect.getattr_static(cls, name)
    except AttributeError:
        return False
    is_data_descriptor = hasattr(type(attribute), "__set__") or hasattr(type(attribute), "__delete__")
    return not is_data_descriptor  # a property would win over the instance anyway


@functools.lru_cache(maxsize=None)
def _step_self_class(cls):
    return type(cls.__name__, (StepSelf, cls), {"__module__": cls.__module__})


def _variables_view(name):
    def get(self):
        # Layers a Replace pass created live only in the converted models,
        # and the layers they replaced no longer run (with a callback, the
        # owner is the user's model, which still holds them).
        session = vars(self)[_RUNTIME]
        return session.in_use(getattr(session.owner, name), name)

    return property(get)


class StepSelf:
    """The mixin of every step stand-in class (first in its MRO)."""

    variables = _variables_view("variables")
    trainable_variables = _variables_view("trainable_variables")
    non_trainable_variables = _variables_view("non_trainable_variables")
    weights = _variables_view("weights")
    trainable_weights = _variables_view("trainable_weights")
    non_trainable_weights = _variables_view("non_trainable_weights")

    @property
    def losses(self):
        # The model's, as Keras reads them, and those the converted graphs'
        # `add_loss` nodes added in this step (`StepLosses`, below).
        session = vars(self)[_RUNTIME]
        return session.step_losses.losses(session.subject, super().losses)

    def __call__(self, *args, **kwargs):
        session = vars(self)[_RUNTIME]
        return session.call(session.subject, args, kwargs)

    def __getattribute__(self, name):
        if name in object.__getattribute__(self, "__dict__")[_SHADOWED]:
            return StepSelf.__getattr__(self, name)
        return object.__getattribute__(self, name)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        session = vars(self)[_RUNTIME]
        value = session.model_attribute(name)
        if isinstance(value, keras.optimizers.Optimizer):
            return OptimizingFacade(
                value, session.rebuild_on_new_variables, session.subject,
                skip=session.dry_running, defer_build=session.build_after_the_dry_run)
        if isinstance(value, keras.Model) and value is not session.subject:
            return session.callee_stand_in(value)
        return value

    def __setattr__(self, name, value):
        setattr(vars(self)[_RUNTIME].owner, name, value)

    def __delattr__(self, name):
        delattr(vars(self)[_RUNTIME].owner, name)

    def __repr__(self):
        return f"<step self of {vars(self)[_RUNTIME].subject.name}>"


class CalleeStandIn:
    """A sub-model as the step sees it: calling it runs its converted graph
    for that call; everything else is the sub-model itself.

    Example:
        ```python
        generator = session.callee_stand_in(model.generator)
        images = generator(noise)            # the converted generator
        generator.trainable_weights          # the generator's own
        ```
    """

    def __init__(self, session, callee):
        object.__setattr__(self, "_kip_session", session)
        object.__setattr__(self, "_kip_callee", callee)

    def __call__(self, *args, **kwargs):
        return self._kip_session.call(self._kip_callee, args, kwargs)

    @property
    def losses(self):
        """The sub-model's losses, and those its converted graph's `add_loss`
        nodes added in this step (`StepLosses`, below)."""
        return self._kip_session.step_losses.losses(self._kip_callee, self._kip_callee.losses)

    def __getattr__(self, name):
        return getattr(self._kip_callee, name)

    def __setattr__(self, name, value):
        setattr(self._kip_callee, name, value)

    def __repr__(self):
        return f"<step view of {self._kip_callee.name}>"


class StepLosses:
    """The conversions run on each thread, by the model they stand for."""

    def __init__(self):
        self._local = threading.local()

    def record(self, callee, converted, outputs):
        """Note that `converted` ran for `callee` (now, in this graph);
        returns `outputs`."""
        ran = self._local.__dict__.setdefault("ran", {})
        ran[id(callee)] = (callee, converted, _current_graph())
        return outputs

    def losses(self, model, keras_losses):
        """`model`'s losses in the step: `keras_losses` (Keras's `losses` of
        the user's `model`) without what the layers the conversions run
        expanded added themselves at an earlier call of the user's model
        (the verification's, the user's own: Keras would clear them at the
        model's next call, which the graph stands for), and with what the
        `AddedLoss` nodes of those conversions added instead."""
        nodes = self._loss_nodes(model)
        stale = {id(loss) for node in nodes if node.adds_for is not None
                 and node.adds_for() is not None
                 for loss in _compat.own_losses(node.adds_for())}
        return ([loss for loss in keras_losses if id(loss) not in stale]
                + [loss for node in nodes for loss in node.losses])

    def _loss_nodes(self, model):
        """The `AddedLoss` nodes of the conversions run for `model` or a
        model inside it, in the graph being traced."""
        inside = {id(layer) for layer in _compat.all_layers(model)}
        graph = _current_graph()
        found = []
        for callee, converted, where in getattr(self._local, "ran", {}).values():
            if id(callee) in inside and where is graph:
                found.extend(loss_nodes(converted))
        return found


def _current_graph():
    """The graph being built (a `tf.function` trace), or None when eager."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
