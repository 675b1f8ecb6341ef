"""`self` of a train / test step that runs through the plugin.

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
  nodes added in the step (`step_losses.py`);
- every other attribute is the model's. With a `PluginModel`, what Keras's
  `compile` set (optimizer, compiled loss and metrics) is the wrapper's,
  the rest (layers, the attributes the model's own `compile` set) the
  wrapped model's.

Example:
    >>> self_ = step_self(session)
    >>> type(model).train_step(self_, data)   # forward through the graph
"""

import functools
import inspect

import keras

from keras_ipu_plugin.training.session.new_variables import OptimizingFacade
from keras_ipu_plugin.runtime.variables import union_of_variables

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
        # `add_loss` nodes added in this step (`step_losses.py`).
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
        >>> generator = session.callee_stand_in(model.generator)
        >>> images = generator(noise)            # the converted generator
        >>> generator.trainable_weights          # the generator's own
    """

    def __init__(self, session, callee):
        object.__setattr__(self, "_kip_session", session)
        object.__setattr__(self, "_kip_callee", callee)

    def __call__(self, *args, **kwargs):
        return self._kip_session.call(self._kip_callee, args, kwargs)

    @property
    def losses(self):
        """The sub-model's losses, and those its converted graph's `add_loss`
        nodes added in this step (`step_losses.py`)."""
        return self._kip_session.step_losses.losses(self._kip_callee, self._kip_callee.losses)

    def __getattr__(self, name):
        return getattr(self._kip_callee, name)

    def __setattr__(self, name, value):
        setattr(self._kip_callee, name, value)

    def __repr__(self):
        return f"<step view of {self._kip_callee.name}>"


__all__ = ["step_self", "StepSelf", "CalleeStandIn"]
