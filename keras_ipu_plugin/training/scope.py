"""`kip.scope`: models compiled inside it train through the plugin.

Nothing in Keras is patched. On entry the scope notes which models exist
and how they were compiled; on exit it finds the models compiled inside it
and gives each the plugin's lazy train / test functions, the slot Keras's own
`fit` / `evaluate` use (`model.train_function`), exactly as `PluginCallback`
does. A later `compile` outside the scope resets those functions, as it
resets Keras's own.
"""

import contextlib
import gc
import weakref

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.passes.infra.manager import validate_passes
from keras_ipu_plugin.passes.annotate import Recompute
from keras_ipu_plugin.runtime.backends import get_backend
from keras_ipu_plugin.training.model import PluginModel
from keras_ipu_plugin.training.routes import training_route
from keras_ipu_plugin.training.session.session import TrainingSession
from keras_ipu_plugin.training.session.step_functions import install as install_functions
from keras_ipu_plugin.training.session.step_functions import installed_session


@contextlib.contextmanager
def scope(strategy=None, passes=(), verify=True, *, num_ipus=None,
          gradient_accumulation_steps=None, recomputation_mode=None,
          allow_recompute=None):
    """Enter `strategy`'s scope; models compiled inside train through the plugin.

    `strategy=None` uses the current strategy (IPUStrategy where the IPU
    backend provides one).

    IPU backend only (given on the portable backend they raise): with
    `strategy=None` the scope first configures the IPU system -- an
    `IPUConfig` with `auto_select_ipus=num_ipus` (default 1) and
    `allow_recompute` (default: whether `passes` has a Recompute pass), then
    `configure_ipu_system()` -- and enters a new IPUStrategy.
    `gradient_accumulation_steps` goes to Graphcore's
    `set_pipelining_options` for pipelined models and to
    `set_gradient_accumulation_options` for the others;
    `recomputation_mode` ("Auto", "RecomputeThenBackpropagate",
    "RecomputeAndBackpropagateInterleaved") to `set_pipelining_options`.
    On the IPU, Graphcore's `fit` never reads `model.train_function`, so only
    `kip.PluginModel`s (whose `fit` hands the converted model to Graphcore's
    `fit`) and converted models train there; other models compiled inside
    raise when the scope exits.

    Example:
        ```python
        with kip.scope(passes=[kip.passes.Expand()]) as strategy:
            model = MyModel()
            model.compile(optimizer="adam", loss="mse")
        model.fit(x, y)          # converted at the first batch
        kip.scope_report(model)  # what the conversion and passes did
        ```
    """
    passes = validate_passes(passes)
    backend = get_backend()
    backend.configure(
        recomputes=any(isinstance(p, Recompute) for p in passes),
        configure_system=strategy is None, num_ipus=num_ipus,
        gradient_accumulation_steps=gradient_accumulation_steps,
        recomputation_mode=recomputation_mode, allow_recompute=allow_recompute,
    )
    strategy = strategy or backend.default_strategy()
    if _compat.reduces_across_workers(strategy):
        raise ValueError(
            "kip.scope cannot plug models into MultiWorkerMirroredStrategy "
            "training: a model created inside the strategy's scope makes "
            "Keras's own `fit` fail in its first symbolic build, before any "
            "plugin code runs, and the plugin does not patch your model. Use "
            "kip.PluginModel (created inside the scope), or create the model "
            "outside the scope, then build, compile and fit it inside "
            "`with strategy.scope():` with kip.PluginCallback."
        )
    before = _compile_states()
    with strategy.scope():
        yield strategy
    compiled = _compiled_since(before)
    # A PluginModel's `compile` runs the wrapped model's own `compile` (a
    # GAN's): the wrapped model trains through its wrapper, not by itself.
    wrapped = {id(model.wrapped) for model in compiled if isinstance(model, PluginModel)}
    for model in compiled:
        if id(model) in wrapped:
            continue
        if isinstance(model, PluginModel):
            install(model, passes, verify)  # it is the plugin already
        elif training_route().plugs_in(model, passes, PluginModel):
            install(model, passes, verify)


def install(model, passes=(), verify=True, rebuild_on_new_variables=True):
    """Route `model.fit` / `evaluate` through the plugin (what the scope does).

    A `PluginModel` is the plugin already: it keeps its own conversion (one
    for the model, not a second one around it), and passes or settings
    other than its own are an error rather than silently dropped.

    Example:
        ```python
        install(model, passes=[kip.passes.Expand()])
        model.fit(x, y)      # converted at the first batch
        ```
    """
    passes = validate_passes(passes)
    plugged = plugged_in(model)
    if plugged is not None:
        session, serving = plugged
        session.check_serves("kip.scope", serving, passes, verify=verify,
                             rebuild_on_new_variables=rebuild_on_new_variables)
        _sessions[model] = session
        return
    session = TrainingSession(model, model, passes, verify=verify,
                      rebuild_on_new_variables=rebuild_on_new_variables)
    install_functions(model, session)
    _sessions[model] = session


def plugged_in(model):
    """`(session, who)` of the plugin that already trains `model`: a
    PluginModel's own session, or the one `kip.scope` gave it (while its
    train / test functions are still the model's); else None.

    Example:
        ```python
        session, who = plugged_in(plugin)   # who: "PluginModel `p`"
        ```
    """
    if isinstance(model, PluginModel):
        return model._kip_session, f"PluginModel `{model.name}`"
    session = _sessions.get(model)
    if session is not None and installed_session(model) is session:
        return session, "kip.scope"
    return None


def scope_report(model):
    """The report of a model plugged in by `kip.scope`, once it has trained."""
    session = _sessions.get(model)
    return None if session is None else session.report


_sessions = weakref.WeakKeyDictionary()


def _compile_states():
    return {
        id(obj): _compat.compile_config(obj)
        for obj in gc.get_objects()
        if isinstance(obj, keras.Model)
    }


def _compiled_since(before):
    found = []
    for obj in gc.get_objects():
        if not isinstance(obj, keras.Model) or not getattr(obj, "compiled", False):
            continue
        config = _compat.compile_config(obj)
        if id(obj) not in before or before[id(obj)] is not config:
            found.append(obj)
    return found
