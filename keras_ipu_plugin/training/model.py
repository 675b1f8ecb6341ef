"""`PluginModel`: a drop-in `keras.Model` that runs its wrapped model's
converted graph. One concept over ~600 lines: the wrapper class, with what
Keras asks of a model (calls, saving, loading, summaries) on it.

The wrapped model is tracked under a dunder attribute, which Keras's saving
skips, and the wrapped model's own attributes are exposed as the wrapper's
(`__getattr__` / `__dir__`), so `save_weights` writes the same variable
paths as the wrapped model: weights saved from either load into the other.
"""

import contextlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.passes.infra.manager import validate_passes
from keras_ipu_plugin.frontend.convert import as_tensors
from keras_ipu_plugin.runtime.variables import union_of_variables
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.layers import saved_values
from keras_ipu_plugin.frontend.inputs import first_batch
from keras_ipu_plugin.frontend.trace.tracer import current_tracer
from keras_ipu_plugin.passes.infra.base import deserialize_pass
from keras_ipu_plugin.passes.infra.base import serialize_pass
from keras_ipu_plugin.training.session.session import TrainingSession
from keras_ipu_plugin.training.session.step_functions import PredictFunction
from keras_ipu_plugin.training.session.step_functions import StepFunction
from keras_ipu_plugin.training.routes import training_route
from keras_ipu_plugin.training.session.new_variables import optimizer_state_in_order
from keras_ipu_plugin.layers.user_code import LIBRARY_PACKAGES
from keras_ipu_plugin.runtime.saved_models import refuse_hdf5

_WRAPPED = "__kip_wrapped__"


# OneReplicaSymbolicBuild: Keras's own symbolic build fails under
# MultiWorkerMirroredStrategy; this class is ours, so its build can take one
# replica's batch instead.
@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class PluginModel(_compat.OneReplicaSymbolicBuild, keras.Model):
    """Wrap a subclassed model; convert it at the first batch it sees.

    `static_batch=True` converts with the batch dimension fixed to the first
    batch's, as `convert_to_functional(..., static_batch=True)` does (a model
    that reshapes to a batch size written as a constant). Compiled inside
    `kip.scope()` or fitted with a `PluginCallback`, it trains as it does
    alone: it is the plugin already, and keeps its one conversion.
    `tracer` (a `Tracer`; the one in use where the model is made by default)
    says where tracing stops at the first conversion and at every rebuild.

    Example:
        ```python
        model = kip.PluginModel(MyModel(), passes=[kip.passes.Expand()])
        model.compile(optimizer="adam", loss="mse")
        model.fit(x, y, epochs=2)
        print(model.kip_report)
        ```
    """

    def __init__(self, model, passes=(), rebuild_on_new_variables=True, verify=True, *,
                 static_batch=False, tracer=None, **kwargs):
        if not isinstance(model, keras.Model):
            raise TypeError(
                f"PluginModel wraps a keras.Model; got {type(model).__name__}."
            )
        kwargs.setdefault("name", f"{model.name}_plugin")
        super().__init__(**kwargs)
        setattr(self, _WRAPPED, model)
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.verify = verify
        # `static_batch=True`: conversions fix the batch dimension, as
        # `convert_to_functional(..., static_batch=True)` does (a model
        # reshaping to a batch size written as a constant).
        self._kip_session = TrainingSession(
            model, self, validate_passes(passes), verify=verify,
            rebuild_on_new_variables=rebuild_on_new_variables,
            static_batch=bool(static_batch),
            # kept for every conversion: the first `fit` and each rebuild
            tracer=current_tracer() if tracer is None else tracer,
        )

    # -- the wrapped model's attributes are the wrapper's ---------------------
    @property
    def wrapped(self):
        return vars(self)[_WRAPPED]

    @property
    def converted(self):
        """The functional model once the first batch has been seen, else None."""
        session = self.__dict__.get("_kip_session")
        return None if session is None else session.converted

    @property
    def built(self):
        """Built once the wrapped model is: the wrapper has no variables of
        its own (saving and loading check this)."""
        wrapped = self.__dict__.get(_WRAPPED)
        return self.__dict__.get("_kip_built", False) or bool(wrapped is not None and wrapped.built)

    @built.setter
    def built(self, value):
        self.__dict__["_kip_built"] = value

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
        models': the layers a Replace pass created live only there, and the
        layers they replaced are no longer used, so not trained. A
        replacement's variable stands where the one it replaces stood (see
        `TrainingSession.in_use`): the optimizer, built over these, saves its state
        in the order that the wrapped model's variables have when the saved
        model is loaded again; appended last, a replaced layer in the middle
        had its saved moments loaded into its neighbour's."""
        mine = getattr(super(), name)
        session = self.__dict__.get("_kip_session")
        return list(mine) if session is None else session.in_use(mine, name)

    # -- saving: the wrapped model's layout --------------------------------------
    def save_weights(self, filepath, *args, **kwargs):
        self._copy_replacements_back()
        with self._optimizer_in_saved_order():
            return super().save_weights(filepath, *args, **kwargs)

    def save(self, filepath, *args, **kwargs):
        refuse_hdf5(self, filepath, kwargs.get("zipped", args[1] if len(args) > 1 else None))
        self._copy_replacements_back()
        with self._optimizer_in_saved_order():
            return super().save(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        with self._optimizer_in_saved_order():
            result = super().load_weights(filepath, *args, **kwargs)
        self._copy_into_replacements()
        return result

    def _optimizer_in_saved_order(self):
        """Keras saves an optimizer's state (with the model, and in weights
        files) by position, and loads it by position into an optimizer built
        over the loaded model's variables, in the wrapped model's order:
        while saving or loading, the optimizer lists its state in that order
        (one extended for new variables holds them last; a grown layer's
        moments loaded into its neighbour's)."""
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not optimizer.built:
            return contextlib.nullcontext()
        return optimizer_state_in_order(optimizer, self.trainable_variables)

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
        session = self.__dict__.get("_kip_session")
        return [] if session is None else session.replaced_layers()

    @property
    def kip_report(self):
        session = self.__dict__.get("_kip_session")
        return None if session is None else session.report

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_tracker", "_kip_session"):
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
        """Convert now for `wrapped(x)`, `x` from `data` (a batch, an
        `(x, y)` tuple or a dataset), unless a conversion serves it already.

        The converted model is not tracked as a sub-layer: its layers are the
        wrapped model's (and `variables` / `weights` add any a pass created).
        """
        self._convert_x(first_batch(data).x)
        return self.converted

    def _convert_x(self, x):
        self._kip_session.convert(as_tensors(x))
        self.built = True  # the wrapped model's variables exist now

    def call(self, inputs, training=None, **kwargs):
        # The wrapped model's call, with its own arguments (`mask=` too),
        # through the graph converted for calls like it (converted now when
        # it is the first such call, on concrete inputs).
        return self._kip_session.call(self.wrapped, (inputs,), dict(kwargs, training=training))

    def compile(self, *args, **kwargs):
        """Compile as the wrapped model's class compiles.

        A model with its own `compile` (a distiller's `student_loss_fn`,
        `alpha`; a GAN's `d_optimizer`, `g_optimizer`) is compiled by it, so
        that what it sets is there for its steps (on the wrapped model: it
        is the user's `compile`, asked for); the wrapper then takes the same
        optimizer, loss and metrics for `fit` to run.

        Example:
            ```python
            plugin = kip.PluginModel(Distiller(student=student, teacher=teacher))
            plugin.compile(optimizer=keras.optimizers.Adam(), metrics=[],
                           student_loss_fn=loss, distillation_loss_fn=kl, alpha=0.1)
            plugin.wrapped.alpha, plugin.optimizer is plugin.wrapped.optimizer
            # -> (0.1, True)
            ```
        """
        wrapped = self.wrapped
        before = dict(vars(self))
        self._kip_session.jit_compile_asked = _asked_jit_compile(wrapped, args, kwargs)
        if type(wrapped).compile is keras.Model.compile:
            super().compile(*args, **kwargs)
        else:
            wrapped.compile(*args, **kwargs)
            arguments = _compat.compile_arguments(wrapped)
            arguments["optimizer"] = wrapped.optimizer
            super().compile(**arguments)
        # What Keras's compile set here is what the steps read from the
        # wrapper (the compiled loss and metrics `fit` resets and reports).
        # A second compile sets some to what they were (`compiled`, `loss`,
        # `_jit_compile`): they stay the wrapper's, or the step would read
        # the wrapped model's own, never compiled, values (`fit` then failed
        # in TensorFlow's iterator code).
        self._kip_session.owner_names = self._kip_session.owner_names | frozenset(
            name for name, value in vars(self).items()
            if name not in before or before[name] is not value
        ) | {"optimizer"}

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
        shape = _saved_input_shape(config, f"PluginModel `{self.name}`")
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
            self.train_function = StepFunction(
                self._kip_session, self._step_method("train_step"), trains=True)
        return self.train_function

    def make_test_function(self, force=False):
        if self.test_function is None or force:
            self.test_function = StepFunction(self._kip_session, self._step_method("test_step"))
        return self.test_function

    def make_predict_function(self, force=False):
        if self.predict_function is None or force:
            super().make_predict_function(force=True)
            function = self.predict_function
            self.predict_function = PredictFunction(
                self._kip_session, self._step_method("predict_step"), function)
        return self.predict_function

    def _step_method(self, name):
        """The wrapped model's override of step `name`, else Keras's own."""
        return getattr(type(self.wrapped), name)

    def compile_from_config(self, config):
        # Keras skips `compile` on load for a class that overrides it, as
        # this one does; the wrapper's own saved compile config is Keras's
        # `compile` arguments, good for it unless the wrapped model has its
        # own `compile` (whose arguments were not saved: Keras then skips
        # compiling too, with its warning).
        if type(self.wrapped).compile is not keras.Model.compile:
            return super().compile_from_config(config)
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    # The wrapped model's methods (its overrides, else Keras's) with the
    # step's `self` (see `step_self`): `self(x)` in them runs the graph.
    def train_step(self, data):
        return self._kip_session.step_self().train_step(data)

    def test_step(self, data):
        return self._kip_session.step_self().test_step(data)

    def predict_step(self, data):
        # Traced inside Keras's predict function: a call with no conversion
        # stops the trace, for `PredictFunction` to convert it.
        with self._kip_session.tracing_step():
            return self._kip_session.step_self().predict_step(data)

    def compute_loss(self, *args, **kwargs):
        return self._kip_session.step_self().compute_loss(*args, **kwargs)

    def compute_metrics(self, *args, **kwargs):
        return self._kip_session.step_self().compute_metrics(*args, **kwargs)

    # On the IPU backend these hand the converted model to Graphcore's own
    # methods (`routes.IpuRoute.run_training`): Graphcore's fit refuses a model
    # that overrides make_train_function, as this one does.
    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        # fit(x, y, batch_size, epochs, verbose, ...): a conversion made for
        # this fit prints its progress when `verbose` is on, as Keras does.
        self._kip_session.verbose = kwargs.get("verbose", args[1] if len(args) > 1 else "auto")
        self._before_first_step(x, batch_size, "fit")
        return training_route().run_training(
            self, "fit", super().fit, x, batch_size, (x, y, batch_size, *args), kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, *args, **kwargs):
        self._before_first_step(x, batch_size, "evaluate")
        return training_route().run_training(
            self, "evaluate", super().evaluate, x, batch_size, (x, y, batch_size, *args), kwargs)

    def predict(self, x, batch_size=None, *args, **kwargs):
        self._before_first_step(x, batch_size, "predict", compiled=False)
        return training_route().run_training(
            self, "predict", super().predict, x, batch_size, (x, batch_size, *args), kwargs)

    def _before_first_step(self, x, batch_size, method, compiled=True):
        if compiled and not self.compiled:
            raise ValueError(
                f"PluginModel `{self.name}`: call `compile(...)` on the wrapper "
                f"before `{method}` (the wrapped model `{self.wrapped.name}` is "
                "trained through it)."
            )
        # Keras's own steps call the model on `x`: converted here, before
        # `fit`'s callbacks start (BackupAndRestore wants a built model; on
        # the IPU, Graphcore's fit is handed the converted model). A dataset's
        # first batch is read without moving its shuffle on (`first_batch`).
        # A step of the wrapped model's own is converted from what it calls,
        # at its first batch (see `training.StepFunction`).
        step = {"fit": "train_step", "evaluate": "test_step", "predict": "predict_step"}[method]
        first_use = self.converted is None
        if first_use and getattr(type(self.wrapped), step) is getattr(keras.Model, step) and x is not None:
            self._convert_x(_first_x(x, batch_size))

    # -- exporting: the converted graph is what serves --------------------------
    def export(self, filepath, format="tf_saved_model", verbose=None, input_signature=None,
               **kwargs):
        """Export the converted graph for serving (Keras's `Model.export`).

        The wrapper itself is never traced as a whole (its calls go through
        the converted graph), so what is exported is `converted`, with the
        input signature of the batch it was converted from (int32 token ids
        stay int32). A SavedModel exported here converts to TFLite with
        `tf.lite.TFLiteConverter.from_saved_model`.

        Example:
            ```python
            plugin.fit(x, y)  # or plugin(x), plugin.predict(x): a batch seen
            plugin.export("served")
            reloaded = tf.saved_model.load("served")
            ```
        """
        converted = self.converted
        if converted is None:
            raise ValueError(
                f"PluginModel `{self.name}` has not seen a batch yet, so it has no "
                "converted graph to export: call it once (`plugin(x)`, `plugin.predict(x)`, "
                "`plugin.fit(...)` or `plugin.convert(x)`) before `export`."
            )
        return converted.export(
            filepath, format=format, verbose=verbose, input_signature=input_signature, **kwargs)

    # -- saving ----------------------------------------------------------------
    def get_config(self):
        refuse_hdf5(self)  # `keras.saving.save_model(plugin, "m.h5")`
        # Passes are saved as the pass objects they became (a config file's
        # path would not travel with the saved model).
        try:
            passes = [serialize_pass(one_pass) for one_pass in self._kip_session.passes]
        except PassError as error:
            raise PassError(
                f"PluginModel `{self.name}` cannot be saved with its passes: {error} "
                "(save_weights saves the weights alone)"
            ) from error
        return {
            "name": self.name,
            "model": keras.saving.serialize_keras_object(self.wrapped),
            "passes": passes,
            "rebuild_on_new_variables": self.rebuild_on_new_variables,
            "verify": self.verify,
            "static_batch": self._kip_session.static_batch,
        }

    @classmethod
    def from_config(cls, config):
        config = _checked_saved_config(config)
        entry = f"PluginModel `{config.get('name')}`"
        config["model"] = saved_values.saved_user_layer(config["model"], entry, "model")
        if not isinstance(config["model"], keras.Model):
            saved_values.refuse(entry, "model", "a saved keras.Model",
                                type(config["model"]).__name__)
        config["passes"] = _saved_passes(config.get("passes", []), entry)
        return cls(**config)


#: The keys `get_config` writes.
_SAVED_KEYS = ("name", "model", "passes", "rebuild_on_new_variables", "verify", "static_batch")


def _checked_saved_config(config):
    """A copy of a saved PluginModel config whose every value is of the
    type `get_config` writes (a `kip.LoadError` naming the key otherwise),
    checked before anything is made from it: `passes` is the list of saved
    passes, never a path to read (`"static_batch": "false"` is no false).

    Example:
        ```python
        _checked_saved_config({"name": "p", "model": {...}, "verify": "no"})
        ```
        Traceback (most recent call last):
        keras_ipu_plugin.errors.LoadError: PluginModel `p`: verify must be true or false ...
    """
    entry = f"PluginModel `{config.get('name') if isinstance(config, dict) else None}`"
    saved_values.saved_keys(config, entry, _SAVED_KEYS)
    if not isinstance(config.get("model"), dict):
        saved_values.refuse(entry, "model", "a saved keras.Model", config.get("model"))
    if not isinstance(config.get("passes", []), (list, dict)):
        saved_values.refuse(entry, "passes", "the list of saved passes", config["passes"])
    if "name" in config:
        saved_values.saved_str(config["name"], entry, "name")
    for key in ("rebuild_on_new_variables", "verify", "static_batch"):
        if key in config:
            saved_values.saved_bool(config[key], entry, key)
    return dict(config)


#: The most values the zeros a loaded PluginModel builds its wrapped model
#: on may hold (per input): the shape is the file's, so it is bounded.
MAX_BUILD_VALUES = 2 ** 24


def _saved_input_shape(config, entry):
    """The input shape of a saved build config: a shape (a list of sizes
    and null) or a list / mapping of them, as Keras writes it, each of at
    most `MAX_BUILD_VALUES` values (null counts 1); a `kip.LoadError`
    naming the key otherwise. The wrapped model is called on zeros of it
    while loading, so a file must not choose gigabytes."""
    key = "build_config.input_shape"
    if config is None:
        return None
    if not isinstance(config, dict):
        saved_values.refuse(entry, "build_config", "a mapping", config)
    shape = config.get("input_shape")
    stack = [(shape, 0)]
    while stack:
        value, depth = stack.pop()
        if value is None and depth == 0:
            continue
        if isinstance(value, dict) and depth < 4:
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, (list, tuple)) and value and all(
                isinstance(item, (list, tuple, dict)) for item in value) and depth < 4:
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, (list, tuple)) and all(
                dim is None or (isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0)
                for dim in value):
            values = 1
            for dim in value:
                values *= 1 if dim is None else dim
            if values > MAX_BUILD_VALUES:
                saved_values.refuse(entry, key, f"at most {MAX_BUILD_VALUES} values an input",
                                    value)
        else:
            saved_values.refuse(entry, key, "a shape (sizes and null), or a list or mapping "
                                "of shapes", shape)
    return shape


def _saved_passes(passes, entry):
    """The passes of a saved PluginModel: the list `serialize_pass` wrote
    (older saves: a config mapping, which is data too), as pass objects;
    any error is a `kip.LoadError` naming the pass."""
    from keras_ipu_plugin.passes.infra.config import passes_from_config

    if isinstance(passes, dict):
        try:
            return passes_from_config(passes)
        except (PassError, ValueError) as error:
            raise LoadError(f"{entry}: passes: {error}") from error
    made = []
    for index, saved in enumerate(passes):
        try:
            made.append(deserialize_pass(saved))
        except (PassError, ValueError) as error:
            raise LoadError(f"{entry}: passes[{index}]: {error}") from error
    return made


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


def _asked_jit_compile(wrapped, args, kwargs):
    """What a `compile(*args, **kwargs)` call asks for jit_compile: "auto",
    True or False; None where it cannot be told (a model's own `compile`,
    which may set it itself, not given it by keyword)."""
    if type(wrapped).compile is keras.Model.compile:
        try:
            bound = inspect.signature(keras.Model.compile).bind(wrapped, *args, **kwargs)
        except TypeError:
            return None  # Keras raises its own error for the call
        return bound.arguments.get("jit_compile", "auto")
    return kwargs.get("jit_compile")


def _zeros(shape):
    if isinstance(shape, dict):
        return {k: _zeros(v) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple, dict)):
        return type(shape)(_zeros(s) for s in shape)
    return np.zeros([1 if d is None else d for d in shape], keras.config.floatx())


def _first_x(x, batch_size):
    """`x` of the first batch: of a dataset's first element, or the first
    `batch_size` (default 32, as in `fit`) rows of arrays (`x` itself: a
    tuple of arrays is several inputs, not `(x, y)`)."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, tf.distribute.DistributedDataset)):
        return first_batch(x).x
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
