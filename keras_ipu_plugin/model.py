"""`PluginModel`: a drop-in `keras.Model` that runs its wrapped model's
converted graph.

The wrapped model is tracked under a dunder attribute, which Keras's saving
skips, and the wrapped model's own attributes are exposed as the wrapper's
(`__getattr__` / `__dir__`), so `save_weights` writes the same variable
paths as the wrapped model: weights saved from either load into the other.
"""

import inspect

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _keras_internals
from keras_ipu_plugin.apply import validate_passes
from keras_ipu_plugin.convert import as_tensors
from keras_ipu_plugin.dynamic import union_of_variables
from keras_ipu_plugin.inputs import first_batch
from keras_ipu_plugin.training import Runtime
from keras_ipu_plugin.training import StepFunction
from keras_ipu_plugin.views import LIBRARY_PACKAGES

_WRAPPED = "__kip_wrapped__"


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class PluginModel(keras.Model):
    """Wrap a subclassed model; convert it at the first batch it sees.

    Example:
        >>> model = kip.PluginModel(MyModel(), passes=[kip.passes.Expand()])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> model.fit(x, y, epochs=2)
        >>> print(model.kip_report)
    """

    def __init__(self, model, passes=(), rebuild_on_new_variables=True, verify=True, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"PluginModel wraps a keras.Model; got {type(model).__name__}."
            )
        kwargs.setdefault("name", f"{model.name}_plugin")
        super().__init__(**kwargs)
        setattr(self, _WRAPPED, model)
        self._kip_passes_config = passes if isinstance(passes, (dict, str)) else None
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.verify = verify
        self._kip_runtime = Runtime(
            model, self, validate_passes(passes), verify=verify,
            rebuild_on_new_variables=rebuild_on_new_variables,
        )

    # -- the wrapped model's attributes are the wrapper's ---------------------
    @property
    def wrapped(self):
        return vars(self)[_WRAPPED]

    @property
    def converted(self):
        """The functional model once the first batch has been seen, else None."""
        runtime = self.__dict__.get("_kip_runtime")
        return None if runtime is None else runtime.converted

    @property
    def layers(self):
        """The wrapped model's layers (what `save_weights` walks, too)."""
        return self.wrapped.layers

    @property
    def variables(self):
        return self._in_use("variables")

    @property
    def weights(self):
        return self._in_use("weights")

    def _in_use(self, name):
        """The wrapped model's `name` (variables or weights) and the converted
        model's: the layers a Replace pass created live only there, and the
        layers they replaced are no longer used, so not trained."""
        mine = getattr(super(), name)
        converted = self.converted
        if converted is None:
            return mine
        unused = {id(v) for old, _ in converted.kip_replaced for v in getattr(old, name)}
        return union_of_variables([v for v in mine if id(v) not in unused], getattr(converted, name))

    # -- saving: the wrapped model's layout --------------------------------------
    def save_weights(self, filepath, *args, **kwargs):
        self._copy_replacements_back()
        return super().save_weights(filepath, *args, **kwargs)

    def save(self, filepath, *args, **kwargs):
        self._copy_replacements_back()
        return super().save(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        result = super().load_weights(filepath, *args, **kwargs)
        self._copy_into_replacements()
        return result

    def _copy_replacements_back(self):
        """Saved weights keep the wrapped model's layout, so that a fresh
        instance of the original class loads them: the trained weights of
        layers a Replace pass created are copied back into the layers they
        replaced (by weight name) before saving."""
        for old, new in self._replaced_pairs():
            _copy_by_name(new, old, "save")

    def _copy_into_replacements(self):
        for old, new in self._replaced_pairs():
            _copy_by_name(old, new, "load")

    def _replaced_pairs(self):
        converted = self.converted
        return () if converted is None else converted.kip_replaced

    @property
    def kip_report(self):
        converted = self.converted
        return None if converted is None else converted.kip_report

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_tracker", "_kip_runtime"):
            raise AttributeError(name)
        wrapped = self.__dict__.get(_WRAPPED)
        if wrapped is None:
            raise AttributeError(name)
        return getattr(wrapped, name)

    def __setattr__(self, name, value):
        wrapped = self.__dict__.get(_WRAPPED)
        if wrapped is not None and self._is_wrapped_attribute(name, wrapped):
            # `plugin.grow = True` means the wrapped model's `grow`: its
            # `call` reads it, and the wrapper's own copy would switch
            # nothing.
            setattr(wrapped, name, value)
            return
        super().__setattr__(name, value)

    def _is_wrapped_attribute(self, name, wrapped):
        """Whether setting `name` on the wrapper means the wrapped model's.

        Yes for an attribute the wrapped model has and the wrapper does not
        (neither its own nor a `keras.Model` one), set by the user's code.
        Keras sets some attributes on a model only at `compile` / `fit`
        (`optimizer`, `history`): on the wrapper those are the wrapper's,
        even where the wrapped model was compiled itself.
        """
        if name in self.__dict__ or hasattr(type(self), name) or name.startswith("__"):
            return False
        if name not in vars(wrapped) and not hasattr(type(wrapped), name):
            return False
        return not _set_by_library_code()

    def __dir__(self):
        # Keras's saving walks `dir()`: list the wrapped model's own
        # attributes and hide the wrapper's views of it, so that saved
        # weights have the wrapped model's layout.
        names = set(super().__dir__()) - {"wrapped", "converted", "kip_report"}
        wrapped = self.__dict__.get(_WRAPPED)
        if wrapped is not None:
            names |= set(dir(wrapped)) - set(dir(keras.Model))
        return sorted(names)

    # -- conversion -------------------------------------------------------------
    def convert(self, data):
        """Convert now from `data` (a batch or a dataset); done once.

        The converted model is not tracked as a sub-layer: its layers are the
        wrapped model's (and `variables` / `weights` add any a pass created).
        """
        if self.converted is None:
            self._kip_runtime.convert(as_tensors(first_batch(data).x))
            self.built = True  # the wrapped model's variables exist now
        return self.converted

    def call(self, inputs, training=None, **kwargs):
        converted = self.converted
        if converted is None:
            if not _is_concrete(inputs):
                # Keras's symbolic build before the first batch: the wrapped
                # model computes the same thing on symbols.
                return self.wrapped(inputs, training=training, **kwargs)
            converted = self.convert(inputs)
        return converted(inputs, training=training, **kwargs)

    def build(self, input_shape):
        # Nothing to build here: the first real batch converts (and builds)
        # the wrapped model, with the right dtypes.
        self.built = True

    def get_build_config(self):
        # The wrapped model's own: without one, `load_model` leaves the
        # wrapper unbuilt, so it does not build the optimizer either, and the
        # saved optimizer state is skipped ("Skipping variable loading").
        return self.wrapped.get_build_config()

    def build_from_config(self, config):
        # `load_model` restores weights right after this, so the wrapped
        # model's variables must exist: call it once on zeros of the saved
        # input shape (float inputs; a model taking strings or ids needs
        # `plugin(first_batch)` before `load_weights` instead).
        shape = (config or {}).get("input_shape")
        if shape is not None and not self.wrapped.built:
            self.wrapped(_zeros(shape))
        self.built = True

    @property
    def metrics(self):
        """The wrapped model's metrics when its class defines them (a custom
        `train_step` with its own trackers), else the compiled ones."""
        if type(self.wrapped).metrics is not keras.Model.metrics:
            return self.wrapped.metrics
        return super().metrics

    # -- training: the wrapped model's own steps, forward through `converted`
    def make_train_function(self, force=False):
        if self.train_function is None or force:
            self.train_function = StepFunction(self._kip_runtime, self._step_method("train_step"))
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = StepFunction(self._kip_runtime, self._step_method("test_step"))
        return self.test_function

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # Keras's version fails under MultiWorkerMirroredStrategy (see
        # `_keras_internals.symbolic_build_from_one_replica`); this class is
        # ours, so its build can take one replica's batch instead.
        _keras_internals.symbolic_build_from_one_replica(self, iterator, data_batch)

    def _step_method(self, name):
        """The wrapped model's override of step `name`, else Keras's own."""
        return getattr(type(self.wrapped), name)

    def train_step(self, data):
        return self._step("train_step", data)

    def test_step(self, data):
        return self._step("test_step", data)

    def predict_step(self, data):
        return self._step("predict_step", data)

    def compute_loss(self, *args, **kwargs):
        return self._step("compute_loss", *args, **kwargs)

    def compute_metrics(self, *args, **kwargs):
        return self._step("compute_metrics", *args, **kwargs)

    def _step(self, name, *args, **kwargs):
        own = getattr(type(self.wrapped), name)
        if own is getattr(keras.Model, name):
            return getattr(super(), name)(*args, **kwargs)
        return own(self, *args, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._before_first_step(x, batch_size, "fit")
        return super().fit(x, y, batch_size, *args, **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._before_first_step(x, batch_size, "evaluate")
        return super().evaluate(x, y, batch_size, *args, **kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._before_first_step(x, batch_size, "predict", compiled=False)
        return super().predict(x, batch_size, *args, **kwargs)

    def _before_first_step(self, x, batch_size, method, compiled=True):
        if compiled and not self.compiled:
            raise ValueError(
                f"PluginModel `{self.name}`: call `compile(...)` on the wrapper "
                f"before `{method}` (the wrapped model `{self.wrapped.name}` is "
                "trained through it)."
            )
        if self.converted is None and x is not None:
            self.convert(_first_slice(x, batch_size))

    # -- saving ----------------------------------------------------------------
    def get_config(self):
        if self._kip_runtime.passes and self._kip_passes_config is None:
            raise ValueError(
                f"PluginModel `{self.name}` was given passes as Python objects; "
                "to save the whole model pass them as a config (dict or file) "
                "so they can be stored, or save the weights only."
            )
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.wrapped),
            "passes": self._kip_passes_config or {},
            "rebuild_on_new_variables": self.rebuild_on_new_variables,
            "verify": self.verify,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["model"] = keras.saving.deserialize_keras_object(config["model"])
        return cls(**config)


def _set_by_library_code():
    """Whether the attribute being set on the wrapper is set by Keras or
    TensorFlow (not by the user's code, nor the plugin acting for it: a
    train step's `self.x = ...` reaches the wrapper through the plugin)."""
    frame = inspect.currentframe().f_back.f_back  # the caller of `__setattr__`
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] != "keras_ipu_plugin":
            return module.split(".")[0] in LIBRARY_PACKAGES
        frame = frame.f_back
    return False


def _is_concrete(inputs):
    return all(
        isinstance(leaf, (np.ndarray, tf.Tensor)) and not isinstance(leaf, keras.KerasTensor)
        and (not tf.is_tensor(leaf) or hasattr(leaf, "numpy"))
        for leaf in keras.tree.flatten(inputs)
    )


def _zeros(shape):
    if isinstance(shape, dict):
        return {k: _zeros(v) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple, dict)):
        return type(shape)(_zeros(s) for s in shape)
    return np.zeros([1 if d is None else d for d in shape], keras.config.floatx())


def _first_slice(x, batch_size):
    """The first batch of `x`: a dataset's first element, or the first
    `batch_size` (default 32, as in `fit`) rows of arrays."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)):
        return x
    if isinstance(x, tf.distribute.DistributedDataset):
        return x
    size = batch_size or 32
    return keras.tree.map_structure(lambda a: a[:size], x)


def _copy_by_name(source, target, action):
    from keras_ipu_plugin.passes.replace import copy_weights_by_name

    try:
        copy_weights_by_name(source, target)
    except ValueError as error:
        raise ValueError(
            f"PluginModel cannot {action} weights in the wrapped model's layout: "
            f"the replacement of `{source.name if action == 'save' else target.name}` "
            f"does not have the same weights. {error}"
        ) from error
