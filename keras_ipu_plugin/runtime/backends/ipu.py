"""The IPU backend: the passes through Graphcore's Poplar SDK, call for call.

Written against Graphcore's SDK 3.4 (the newest release branch in Graphcore's
repositories): `graphcore/tensorflow` and `graphcore/keras` branch
`r2.6/sdk-release-3.4`, `graphcore/ipu_tensorflow_addons` branch
`r2.6/sdk-release-3.4`, and the TF2 BERT scripts of `graphcore/examples`.
That SDK ships TensorFlow 2.6.3 with Graphcore's fork of Keras 2.6; this library
needs TensorFlow >= 2.16 and Keras 3, so it cannot be imported there, and
nothing in this module has ever run on an IPU. The tests check every call
against `tests/ipu_standin.py`, a stand-in written for this project that
enforces the SDK's signatures and argument conventions.

What each pass becomes, and where the SDK defines it:

- Outline: `ipu.outlined_function(func, unique_sharding=, keep_input_layouts=,
  name=)` (tensorflow/python/ipu/ops/functional_ops.py). `func` takes
  positional arguments only, each a tensor; everything else is closed over, as
  Graphcore's BERT script does (keras_extensions/model_transformations.py,
  `ModelOutlining.outline_layer_inplace`). Identical bodies are shared by the
  Poplar compiler, not by Python.
- Recompute: `ipu.pipelining_ops.recomputation_checkpoint(tensors)` on the
  outputs of each checkpointed layer (pipelining_ops.py), with
  `IPUConfig.allow_recompute = True` (config.py).
- PipelineStages: `model.get_pipeline_stage_assignment()` /
  `set_pipeline_stage_assignment()` then `set_pipelining_options(
  gradient_accumulation_steps_per_replica=, device_mapping=, recomputation_mode=)`
  (keras/ipu/extensions/functional_extensions.py; the order the BERT script's
  run_pretraining.py uses).
- Training: Graphcore's `fit` under `IPUStrategy` builds its own train function
  and never reads `model.train_function`
  (keras/ipu/extensions/extensions_base.py, `_make_ipu_train_function_wrapper`),
  so the plugin hands it the converted functional model instead.

Example:
    ```python
    with kip.scope(passes=[kip.passes.Recompute(Block)], num_ipus=1,
                   gradient_accumulation_steps=4):
        model = kip.PluginModel(MyModel(), passes=[kip.passes.Recompute(Block)])
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    model.fit(dataset)   # Graphcore's fit, on the converted model
    ```
"""

import contextlib
import dataclasses
import re

import keras
import numpy as np
import tensorflow as tf

from keras_ipu_plugin.errors import IpuError
from keras_ipu_plugin.errors import PassError

#: The keyword arguments of `ipu.outlined_function` besides `func`, with the
#: types the SDK documents (functional_ops.py): no other keyword exists.
OUTLINE_KEYWORDS = {
    "unique_sharding": (bool,),
    "keep_input_layouts": (bool, type(None)),
    "name": (str,),
}

#: `ipu.pipelining_ops.RecomputationMode` members (pipelining_ops.py).
RECOMPUTATION_MODES = ("Auto", "RecomputeThenBackpropagate", "RecomputeAndBackpropagateInterleaved")

WHY_NO_KERAS_EXTENSIONS = (
    "Graphcore's Keras (its fork of Keras 2.6, keras/engine/base_layer.py "
    "`_patch_keras_extension`) adds that API to models created inside an "
    "IPUStrategy scope; a Keras 3 model never has it"
)


def check_outline_kwargs(kwargs):
    """Refuse keyword arguments `ipu.outlined_function` does not have.

    Example:
        ```python
        check_outline_kwargs({"unique_sharding": True})
        # -> {'unique_sharding': True}
        ```
    """
    for key, value in kwargs.items():
        if key not in OUTLINE_KEYWORDS:
            raise PassError(
                f"Outline: `{key}` is not an argument of Graphcore's "
                f"ipu.outlined_function (it takes {', '.join(OUTLINE_KEYWORDS)})."
            )
        if not isinstance(value, OUTLINE_KEYWORDS[key]):
            kinds = " or ".join("None" if t is type(None) else t.__name__ for t in OUTLINE_KEYWORDS[key])
            raise PassError(f"Outline: `{key}` must be {kinds}; got {value!r}.")
    return dict(kwargs)


@dataclasses.dataclass
class IpuSettings:
    """What `kip.scope` was told for the IPU (None: not given)."""

    num_ipus: object = None
    gradient_accumulation_steps: object = None
    recomputation_mode: object = None
    allow_recompute: object = None  # None: not known (the system was configured elsewhere)


class _OutlinedCall:
    """Calls `fn(*structured_args)` through `ipu.outlined_function`.

    The executor calls an outlined body with lists (weights, state) and a dict
    (tensor keyword arguments); the SDK's function takes only tensors,
    positionally. So the tensors among the leaves are passed positionally and
    everything else (None, Python numbers, the nesting) is closed over, and a
    function is made per call, the way Graphcore's BERT script outlines layers.
    """

    def __init__(self, outlined_function, fn, kwargs):
        self.outlined_function = outlined_function
        self.fn = fn
        self.kwargs = kwargs

    def __call__(self, *structured):
        leaves = keras.tree.flatten(structured)
        positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def body(*tensors):
            filled = list(leaves)
            for position, tensor in zip(positions, tensors):
                filled[position] = tensor
            return self.fn(*keras.tree.pack_sequence_as(structured, filled))

        outlined = self.outlined_function(body, **self.kwargs)
        return outlined(*[leaves[i] for i in positions])


class IpuBackend:
    """The passes and training through Graphcore's SDK (never run on an IPU)."""

    name = "ipu"
    recomputes_segments = False
    #: IPU programs have static shapes: conversions fix the batch dimension.
    static_batch = True

    def __init__(self, ipu, addons_layers=None):
        self.ipu = ipu
        self.addons_layers = addons_layers
        self.settings = IpuSettings()

    # -- passes at run time ------------------------------------------------------
    def checkpoint_segment(self, fn, anchored=None):  # pragma: no cover - not used on IPU
        return fn

    def checkpoint_outputs(self, tensors):
        """One `recomputation_checkpoint` over a layer's outputs."""
        if self.settings.allow_recompute is False:
            raise IpuError(
                "Recompute on the IPU: the IPU system was configured by kip.scope "
                "with allow_recompute=False, so Poplar would not recompute and the "
                "checkpoints would do nothing. Give the Recompute pass to "
                "kip.scope(passes=...) too, or pass allow_recompute=True."
            )
        return list(self.ipu.pipelining_ops.recomputation_checkpoint(list(tensors)))

    def outline(self, fn, **kwargs):
        """`fn` (the executor's shared body) called through `ipu.outlined_function`."""
        return _OutlinedCall(self.ipu.outlined_function, fn, check_outline_kwargs(kwargs))

    def stage_scope(self, stage, devices):
        # Stages take effect through Graphcore's pipeline (assign_stages).
        return contextlib.nullcontext()

    # -- pipeline stages -----------------------------------------------------------
    def check_stage_devices(self, names, where):
        """Nothing to check here: IPU stage devices are mapped, and checked,
        by `device_mapping` when the stages are assigned."""

    def assign_stages(self, model, stages):
        """Give `model`'s stages to Graphcore's Keras pipeline API, then its
        pipelining options; raise when that cannot be done.

        Example:
            ```python
            backend.assign_stages(passed, passed.kip_layer_stages)
            ```
        """
        if not hasattr(model, "get_pipeline_stage_assignment"):
            raise IpuError(
                f"PipelineStages on the IPU: model `{model.name}` has no "
                "get_pipeline_stage_assignment (Graphcore's Keras pipeline API). "
                f"{WHY_NO_KERAS_EXTENSIONS}, so the stages cannot reach the IPU. "
                "Convert and pass the model inside kip.scope() with a Keras that "
                "provides the API, or leave out PipelineStages."
            )
        options = self._pipelining_options(model, stages)
        _check_shared_layer_stages(model)
        assignments = model.get_pipeline_stage_assignment()
        for assignment in assignments:
            _assign_stage(assignment, stages, model.name)
        model.set_pipeline_stage_assignment(assignments)
        model.set_pipelining_options(**options)
        return stages

    def _pipelining_options(self, model, stages):
        steps = self.settings.gradient_accumulation_steps
        if steps is None:
            raise IpuError(
                f"PipelineStages on the IPU: model `{model.name}` is pipelined, and "
                "a pipelined model always accumulates gradients (Graphcore's Keras "
                "raises ValueError in fit without "
                "set_pipelining_options(gradient_accumulation_steps_per_replica=...)). "
                "Pass kip.scope(gradient_accumulation_steps=N)."
            )
        options = {"gradient_accumulation_steps_per_replica": steps}
        mapping = device_mapping(getattr(model, "kip_stage_devices", None), max(stages.values()) + 1)
        if mapping is not None:
            options["device_mapping"] = mapping
        if self.settings.recomputation_mode is not None:
            modes = self.ipu.pipelining_ops.RecomputationMode
            options["recomputation_mode"] = getattr(modes, self.settings.recomputation_mode)
        return options

    # -- system, strategy and training -----------------------------------------------
    def configure(self, *, recomputes=False, configure_system=True, num_ipus=None,
                  gradient_accumulation_steps=None, recomputation_mode=None,
                  allow_recompute=None):
        """Record the IPU options of `kip.scope` and, unless the caller brought
        its own strategy, configure the IPU system: `IPUConfig` with
        `auto_select_ipus` and `allow_recompute` (default: `recomputes`, whether
        the scope's passes recompute), then `configure_ipu_system()`."""
        _check_positive("num_ipus", num_ipus, allow_list=True)
        _check_positive("gradient_accumulation_steps", gradient_accumulation_steps)
        if recomputation_mode is not None and recomputation_mode not in RECOMPUTATION_MODES:
            raise IpuError(
                f"kip.scope: recomputation_mode={recomputation_mode!r} is not one of "
                f"Graphcore's RecomputationMode members ({', '.join(RECOMPUTATION_MODES)})."
            )
        if allow_recompute is not None and not isinstance(allow_recompute, bool):
            raise IpuError(
                f"kip.scope: allow_recompute must be True, False or None; got {allow_recompute!r}.")
        if allow_recompute is None:
            allow_recompute = recomputes
        self.settings = IpuSettings(
            num_ipus=num_ipus,
            gradient_accumulation_steps=gradient_accumulation_steps,
            recomputation_mode=recomputation_mode,
            allow_recompute=allow_recompute if configure_system else None,
        )
        if configure_system:
            config = self.ipu.config.IPUConfig()
            config.auto_select_ipus = 1 if num_ipus is None else num_ipus
            config.allow_recompute = allow_recompute
            config.configure_ipu_system()

    def ipu_layers(self):
        """`ipu_tensorflow_addons.keras.layers`, for the IPU Replace preset."""
        if self.addons_layers is None:
            raise IpuError(
                "kip.ipu_replacements(): ipu_tensorflow_addons is not installed; it "
                "provides the IPU layers (pip install the wheel shipped with the "
                "Poplar SDK)."
            )
        return self.addons_layers

    def default_strategy(self):
        """The current strategy, else a new Graphcore IPUStrategy (which needs
        the IPU system configured: `configure` first)."""
        if tf.distribute.has_strategy():
            return tf.distribute.get_strategy()
        return self.ipu.ipu_strategy.IPUStrategy()

def device_mapping(stage_devices, num_stages):
    """Graphcore's `device_mapping` (an IPU index per stage) from
    `model.kip_stage_devices` (ints, or device names ending in `IPU:<n>`),
    repeated over the stages as the portable backend places them; None when
    no devices are given.

    Example:
        ```python
        device_mapping(["/device:IPU:0", 1], 3)
        # -> [0, 1, 0]
        ```
    """
    if not stage_devices:
        return None
    indices = []
    for position, device in enumerate(stage_devices):
        if isinstance(device, (int, np.integer)) and not isinstance(device, bool):
            indices.append(int(device))
            continue
        found = re.search(r"IPU:(\d+)$", str(device), flags=re.IGNORECASE)
        if found is None:
            raise IpuError(
                f"kip_stage_devices[{position}] = {device!r} names no IPU; on the "
                "IPU backend give IPU indices (0, 1, ...) or '/device:IPU:<n>'."
            )
        indices.append(int(found.group(1)))
    return [indices[stage % len(indices)] for stage in range(num_stages)]


def _assign_stage(assignment, stages, model_name, inherited=None):
    """Set `assignment.pipeline_stage`; a nested model's assignments (no
    `.layer`) all take the stage of the nested model's node."""
    if getattr(assignment, "is_nested_model", False):
        nested = assignment.nested_model
        stage = inherited if inherited is not None else stages.get(nested.name)
        if stage is None:
            raise IpuError(
                f"PipelineStages on the IPU: nested model `{nested.name}` in "
                f"`{model_name}` has no stage."
            )
        for inner in assignment.pipeline_stage_assignments:
            _assign_stage(inner, stages, model_name, inherited=stage)
        return
    if inherited is not None:
        assignment.pipeline_stage = inherited
        return
    name = assignment.layer.name
    if name not in stages:
        raise IpuError(
            f"PipelineStages on the IPU: Graphcore lists layer `{name}` (call "
            f"{assignment.node_index}) of `{model_name}`, which has no stage in "
            "kip_layer_stages; every layer call needs one."
        )
    assignment.pipeline_stage = stages[name]


def _check_shared_layer_stages(model):
    """Refuse a layer called at several places in different stages: stages
    are recorded per layer, so Graphcore's per-call (`node_index`) assignment
    could not say which call goes where."""
    graph = getattr(model, "kip_graph", None)
    if graph is None:
        return
    calls = {}
    for node in graph.nodes:
        if "stage" in node.annotations:
            calls.setdefault(id(node.operation), []).append(node)
    for nodes in calls.values():
        stages = [node.annotations["stage"] for node in nodes]
        if len(set(stages)) > 1:
            paths = ", ".join(f"`{node.name}` (stage {stage})" for node, stage in zip(nodes, stages))
            raise IpuError(
                f"PipelineStages on the IPU: layer `{getattr(nodes[0].operation, 'name', nodes[0].name)}` "
                f"is called at {paths}. Its stage is recorded once per layer, so "
                "Graphcore's per-call assignment cannot be told which call goes "
                "where; put every call of a shared layer in the same stage."
            )


def _check_positive(name, value, allow_list=False):
    if value is None:
        return
    values = value if allow_list and isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise IpuError(f"kip.scope: {name} must be a positive integer; got {value!r}.")
