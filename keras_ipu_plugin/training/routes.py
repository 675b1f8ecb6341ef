"""How `fit` reaches the converted graph: one route per backend.

Portable: Keras's own `fit` / `evaluate` call `model.train_function`, which
the plugin sets (`step_functions.StepFunction`), so PluginModel, PluginCallback and
`kip.scope` all work through it.

IPU (Graphcore's SDK, written against SDK 3.4 and never run on an IPU, see
the README): Graphcore's `fit` under IPUStrategy builds its own train
function and never reads `model.train_function`, and refuses a model that
overrides `make_train_function` or `train_step`. So PluginModel hands the
converted functional model to Graphcore's own method, and the entry points
that work by setting `model.train_function` refuse to run.

Example:
    ```python
    training_route().run_training(plugin, "fit", keras_fit, x, 32, args, kwargs)
    ```
"""

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import IpuError
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.runtime.functional import KipFunctional
from keras_ipu_plugin.runtime.backends.ipu import WHY_NO_KERAS_EXTENSIONS


class PortableRoute:
    """Keras's own `fit` runs the plugin's train function."""

    def __init__(self, backend):
        self.backend = backend

    def check_train_function_route(self, entry_point):
        """Keras's fit calls `model.train_function`: the route works here."""

    def plugs_in(self, model, passes, plugin_model_class):
        return True

    def run_training(self, owner, method, keras_method, x, batch_size, args, kwargs):
        """Keras's own `fit` / `evaluate` / `predict` (`args`, `kwargs`)."""
        return keras_method(*args, **kwargs)


class IpuRoute:
    """Graphcore's `fit` trains the converted functional model."""

    def __init__(self, backend):
        self.backend = backend

    def check_train_function_route(self, entry_point):
        """Refuse entry points that work by setting `model.train_function`."""
        raise IpuError(
            f"{entry_point} cannot train through the plugin on the IPU backend: "
            "Graphcore's fit under IPUStrategy builds its own train function and "
            "never reads model.train_function (keras/ipu/extensions/extensions_base.py), "
            "so the plugin would be bypassed without a word. Use "
            "kip.PluginModel(model, passes=...) created inside kip.scope(): its fit "
            "hands the converted functional model to Graphcore's fit."
        )

    def plugs_in(self, model, passes, plugin_model_class):
        """Whether `kip.scope` should install the plugin's train functions on
        `model`: never on IPU (see `check_train_function_route`). A PluginModel
        needs none; a converted model is trained by Graphcore's fit as it is,
        unless the scope was given passes it would then silently skip."""
        if isinstance(model, plugin_model_class):
            return False
        if isinstance(model, KipFunctional) and not passes:
            return False
        self.check_train_function_route(f"kip.scope (model `{model.name}`)")

    def run_training(self, owner, method, keras_method, x, batch_size, args, kwargs):
        """`PluginModel.fit` / `evaluate` / `predict` on the IPU: hand the
        converted functional model to Graphcore's own method, with the same
        arguments (`args`, `kwargs`; `x` and `batch_size` among them).

        Graphcore's fit ignores `model.train_function` and refuses a model that
        overrides `make_train_function` or `train_step` (RuntimeError), so the
        wrapper cannot run its own steps; the converted model, a functional
        model, is what Graphcore's Keras trains. Its History, callbacks'
        `model` and metrics are the converted model's.
        """
        del keras_method  # the wrapper's own method is what the IPU refuses
        # First: a model with steps of its own is not converted at `fit`'s
        # start (its steps say what they call), and is refused here anyway.
        _refuse_own_steps(owner, method)
        converted = owner.converted
        if converted is None:
            raise IpuError(
                f"PluginModel `{owner.name}`: {method} on the IPU needs data to "
                "convert the model from first (call it with `x`)."
            )
        strategy = owner.distribute_strategy
        if not isinstance(strategy, self.backend.ipu.ipu_strategy.IPUStrategyV1):
            raise IpuError(
                f"PluginModel `{owner.name}` was created under {type(strategy).__name__}, "
                "not an IPUStrategy: create it inside kip.scope(), which configures "
                "the IPU system and enters one."
            )
        if not hasattr(converted, "set_gradient_accumulation_options"):
            raise IpuError(
                f"PluginModel `{owner.name}`: the converted model `{converted.name}` "
                f"has no Graphcore Keras extension (fit, gradient accumulation): "
                f"{WHY_NO_KERAS_EXTENSIONS}, so it cannot be trained on the IPU."
            )
        if converted.kip_layer_stages:
            raise IpuError(
                f"PluginModel `{owner.name}`: the converted model is pipelined "
                "(PipelineStages), and Graphcore's Keras runs a pipelined functional "
                "model layer by layer and refuses one whose `call` is overridden "
                "(RuntimeError, FunctionalExtension._validate_call_function in "
                "keras/ipu/extensions/functional_extensions.py). The converted "
                "model's `call` is what runs pinned `training` values, outlined "
                "calls and recomputation checkpoints, so pipelined training "
                "through the plugin is not possible on the IPU."
            )
        _check_static_data(converted, x, batch_size, method)
        self._compile_like(converted, owner)
        if method == "fit":
            self._set_gradient_accumulation(converted, owner)
        converted.kip_report.add_once(
            "ipu", converted.name, f"{method} by Graphcore's Keras",
            "the converted model is trained; model.train_function is not used under IPUStrategy")
        return getattr(converted, method)(*args, **kwargs)

    def _compile_like(self, converted, owner):
        """Compile `converted` as `owner` was, with `owner`'s optimizer object."""
        arguments = _compat.compile_arguments(owner)
        if arguments is None or getattr(converted, "optimizer", None) is owner.optimizer:
            return
        arguments["optimizer"] = owner.optimizer
        converted.compile(**arguments)

    def _set_gradient_accumulation(self, converted, owner):
        steps = self.backend.settings.gradient_accumulation_steps
        if self.backend.settings.recomputation_mode is not None:
            raise IpuError(
                f"PluginModel `{owner.name}`: recomputation_mode is a pipelining "
                "option (set_pipelining_options) and this model is not pipelined; "
                "leave it out of kip.scope, or add PipelineStages."
            )
        if steps is None:
            return
        per_execution = (_compat.compile_arguments(converted) or {}).get("steps_per_execution") or 1
        if per_execution % steps:
            raise IpuError(
                f"PluginModel `{owner.name}`: steps_per_execution={per_execution} is "
                f"not a multiple of gradient_accumulation_steps={steps} (Graphcore's "
                "fit raises RuntimeError); compile with steps_per_execution=k*"
                f"{steps}."
            )
        converted.set_gradient_accumulation_options(gradient_accumulation_steps_per_replica=steps)


def _refuse_own_steps(owner, method):
    """Graphcore's fit refuses an overridden train_step / make_train_function
    (RuntimeError), and the converted model would not run the wrapped model's
    own steps: say so instead of dropping them."""
    step = {"fit": "train_step", "evaluate": "test_step", "predict": "predict_step"}[method]
    maker = {"fit": "make_train_function", "evaluate": "make_test_function",
             "predict": "make_predict_function"}[method]
    wrapped = owner.wrapped
    for name in (step, maker):
        if getattr(type(wrapped), name) is not getattr(keras.Model, name):
            raise IpuError(
                f"PluginModel `{owner.name}`: `{wrapped.name}` overrides `{name}`. "
                f"Graphcore's {method} under IPUStrategy refuses models that override "
                f"`{step}` or `{maker}` (RuntimeError in "
                "keras/ipu/extensions/extensions_base.py), and the converted model "
                "it trains would not run yours."
            )



def _check_static_data(converted, x, batch_size, method):
    """IPU programs have static shapes: the converted model's batch must be
    fixed and every batch of `x` must have it (Graphcore's data adapter
    refuses partial batches and undefined shapes)."""
    batches = {t.shape[0] for t in converted.inputs}
    if None in batches:
        raise IpuError(
            f"{method} on the IPU: the converted model `{converted.name}` has a "
            "dynamic batch dimension; convert with static_batch=True."
        )
    batch = batches.pop()
    if isinstance(x, tf.data.Dataset):
        features = x.element_spec
        if isinstance(features, tuple) and features:
            features = features[0]
        for spec in tf.nest.flatten(x.element_spec):
            if not spec.shape.is_fully_defined():
                raise IpuError(
                    f"{method} on the IPU: the dataset has an element of shape "
                    f"{spec.shape}, not fully defined; batch it with "
                    "`dataset.batch(n, drop_remainder=True)`."
                )
        sizes = {spec.shape[0] for spec in tf.nest.flatten(features)}
        if sizes != {batch}:
            raise IpuError(
                f"{method} on the IPU: the dataset's batches have {sorted(sizes)} rows, "
                f"but the converted model `{converted.name}` was built for {batch}."
            )
        return
    leaves = tf.nest.flatten(x)
    if not leaves or not all(isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in leaves):
        raise IpuError(
            f"{method} on the IPU takes arrays, tensors or a batched tf.data.Dataset "
            f"(Graphcore's data adapter needs shapes ahead of time); got "
            f"{type(x).__name__}."
        )
    size = batch_size or 32  # Keras's default
    rows = int(leaves[0].shape[0])
    if size != batch:
        raise IpuError(
            f"{method} on the IPU: batch_size={size}, but the converted model "
            f"`{converted.name}` was built for batches of {batch}."
        )
    if rows % size:
        raise IpuError(
            f"{method} on the IPU: {rows} rows do not split into batches of {size}; "
            "Graphcore's fit refuses a partial last batch. Drop or pad the remainder."
        )


#: The route for each backend, by `backend.name`.
ROUTES = {"portable": PortableRoute, "ipu": IpuRoute}


def training_route():
    """The route `fit` takes on this process's backend."""
    backend = get_backend()
    return ROUTES[backend.name](backend)
