"""`PluginCallback`: convert the model being fitted at `on_train_begin`."""

import keras

from keras_ipu_plugin.passes.infra.manager import validate_passes
from keras_ipu_plugin.training.routes import training_route
from keras_ipu_plugin.training.scope import plugged_in
from keras_ipu_plugin.training.session.session import TrainingSession
from keras_ipu_plugin.training.session.step_functions import StepFunction
from keras_ipu_plugin.training.session.step_functions import install


class PluginCallback(keras.callbacks.Callback):
    """Run the rest of `fit` through the converted, passed graph.

    At `on_train_begin` the callback gives `fit` a train function that reads
    the first batch from the iterator `fit` already made (that batch is
    trained on as usual, not skipped or read twice), converts the model under
    its strategy, applies the passes and runs the model's own `train_step`
    with the forward pass through the converted graph. The user's model
    keeps its variables, updated in place.

    `static_batch=True` converts with the batch dimension fixed, as
    `convert_to_functional(..., static_batch=True)` does. On a model that
    trains through the plugin already (a `PluginModel`, a model compiled
    inside `kip.scope()`) the callback uses that model's conversion; passes
    or settings other than its own are then an error, not ignored.

    Not on the IPU backend: Graphcore's `fit` never reads
    `model.train_function`, so the callback raises there (use PluginModel).

    Example:
        ```python
        callback = kip.PluginCallback(passes=[kip.passes.Expand()])
        model.fit(dataset, epochs=2, callbacks=[callback])
        print(callback.kip_report)
        ```
    """

    def __init__(self, passes=(), rebuild_on_new_variables=True, verify=True, *,
                 static_batch=False):
        super().__init__()
        training_route().check_train_function_route("PluginCallback")
        self.passes = validate_passes(passes)
        self.rebuild_on_new_variables = rebuild_on_new_variables
        self.verify = verify
        self.static_batch = static_batch
        self.session = None

    @property
    def converted(self):
        return None if self.session is None else self.session.converted

    @property
    def kip_report(self):
        return None if self.session is None else self.session.report

    def on_train_begin(self, logs=None):
        if getattr(self.model, "optimizer", None) is None:
            raise ValueError(f"PluginCallback: model `{self.model.name}` is not compiled.")
        plugged = plugged_in(self.model)
        if plugged is not None:
            # A PluginModel, or a model compiled inside kip.scope, trains
            # through the plugin already: its conversion serves this fit
            # (a second one around it recursed, or converted twice).
            session, serving = plugged
            session.check_serves(
                "PluginCallback", serving, self.passes, verify=self.verify,
                rebuild_on_new_variables=self.rebuild_on_new_variables,
                static_batch=self.static_batch)
            self.session = session
            session.verbose = (self.params or {}).get("verbose", 0)
            return
        if self.session is None or self.session.subject is not self.model:
            self.session = self._installed_session() or TrainingSession(
                self.model, self.model, self.passes, verify=self.verify,
                rebuild_on_new_variables=self.rebuild_on_new_variables,
                static_batch=self.static_batch,
            )
        self.session.verbose = (self.params or {}).get("verbose", 0)
        install(self.model, self.session)

    def _installed_session(self):
        """The session of the train function an earlier callback (or
        `kip.scope`) gave the model, when it converts as this one would.

        Keras keeps a model's train function until `compile` (or
        `make_train_function(force=True)`) drops it: its traced step, with
        the trainable variables of its trace, runs again in the next `fit`
        (a layer set `trainable = False` in between still trains, as Keras's
        docstring of `trainable` warns). A new callback taking over that
        function trains as plain Keras does; a new one would trace anew."""
        installed = getattr(self.model, "train_function", None)
        if not isinstance(installed, StepFunction):
            return None
        session = installed.session
        if (session.subject is not self.model or session.owner is not self.model
                or session.verify != self.verify
                or session.rebuild_on_new_variables != self.rebuild_on_new_variables
                or not _same_passes(session.passes, self.passes)):
            return None
        return session


def _same_passes(ours, theirs):
    """Whether two pass lists are the same passes with the same configs."""
    if len(ours) != len(theirs):
        return False
    for a, b in zip(ours, theirs):
        if a is b:
            continue
        if type(a) is not type(b):
            return False
        try:
            if a.get_config() != b.get_config():
                return False
        except Exception:  # a config that cannot be written: not known equal
            return False
    return True
