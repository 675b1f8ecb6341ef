"""`KipFunctional`: the functional model class every conversion returns.

It is an ordinary Keras functional model with three additions, all stored in
its config so they survive `save` / `load_model`:

- `kip_pinned_training`: layers the original code called with a hard-coded
  `training=` value (a frozen BatchNormalization). Keras's own functional
  model overwrites those with the outer `training`; this one keeps them
  (its nodes hold them per call site).
- `kip_graph` (not saved): the IR graph the passes produced, which is what
  runs (`runtime/interpreter.py`; the interpreter, `interpreter.py`, runs it
  with the run-time effects of its nodes' annotations).
- `kip_node_annotations`: what the Outline / Recompute / PipelineStages
  passes (and any other) recorded, saved by node path, per call site: a
  layer called at two sites may be checkpointed, or staged, at one only.
  `kip_annotations` shows them by Keras layer name (what the backends see).
- `kip_original_mask`: what an explicit `mask=` meant to the original model
  (see `mask_semantics`); a mask this graph cannot apply the way the
  original would is refused, never applied differently.
- `kip_layer_paths`: `{node path: Keras name}` of every node (an expanded
  layer keeps its own name, `dense`, at path `block_1.dense`), in call
  order, so `kip_layer(path)` finds a layer by its path, loaded models
  too, and a loaded model's graph gets its paths back.
  `kip_pinned_training` is keyed by Keras layer name; each node holds its
  own `training`, saved by node path (`kip_node_training`).
- `kip_output_modes`: where the original returns another output structure
  in training than in inference (`layers/opaque.py`), which of the flat
  outputs make each mode's structure; a call returns its mode's.
- `kip_report` (not saved): the report of the conversion and passes.

Every call checks that each input has the dtype kind (int, float, bool,
string) the model was converted with: Keras's functional model would cast
a float batch to an int input silently. What a saved one may hold, checked
before loading makes anything of it, is `saved_models.py`'s.
"""

import inspect

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import check_dtype_kinds
from keras_ipu_plugin.layers.state import link_shared_variables
from keras_ipu_plugin.layers.state import mark_shared_variables
from keras_ipu_plugin.layers.user_code import takes_training
from keras_ipu_plugin.runtime import effects  # noqa: F401 (registers the built-in run-time effects)
# Every kip layer a saved graph may hold is registered with Keras wherever a
# graph can be loaded, not only once the code that records it has run
# (`TensorSizedOperation` was registered by tracing alone).
from keras_ipu_plugin.layers import alias, opaque  # noqa: F401
from keras_ipu_plugin.layers.keras_ops import batch_sized, masks, random_draws, tensor_sized  # noqa: F401
from keras_ipu_plugin.layers import state, tf_calls  # noqa: F401
from keras_ipu_plugin.runtime.interpreter import graph_of
from keras_ipu_plugin.runtime.interpreter import interpreter_for
from keras_ipu_plugin.runtime.saved_models import (
    MASK_ABSENT,
    MASK_ARGUMENT,
    MASK_ON_INPUTS,
    check_output_modes,
    check_saved_entries,
    refuse_hdf5,
)


def mask_semantics(model):
    """What `model(x, mask=m)` does with `m`, as a `kip_original_mask` value.

    A functional model puts the mask on its inputs; a subclassed model hands
    it to its own `call`, which may do anything with it (or rejects it when
    `call` has no `mask` parameter).

    Example:
        ```python
        mask_semantics(keras.Sequential([keras.layers.Dense(2)]))
        # -> 'inputs'
        ```
    """
    if isinstance(model, _compat.Functional):
        return MASK_ON_INPUTS
    if "mask" in inspect.signature(model.call).parameters:
        return MASK_ARGUMENT
    return MASK_ABSENT


def adopt_call_semantics(converted, source):
    """Make the `KipFunctional` `converted` take a mask and `fit`'s `training`
    as the model it was made from takes them: `source`, the user's model it
    was converted from, or the `KipFunctional` passes were applied to (whose
    own are then kept).

    Example:
        ```python
        adopt_call_semantics(converted, model)
        converted.kip_original_mask, converted.kip_call_takes_training
        # -> ('absent', False)
        ```
    """
    if isinstance(source, KipFunctional):
        converted.kip_original_mask = source.kip_original_mask
        converted.kip_call_takes_training = source.kip_call_takes_training
    else:
        converted.kip_original_mask = mask_semantics(source)
        converted.kip_call_takes_training = takes_training(source)


def graph_model(model, caller):
    """`model`, or the converted graph of a `PluginModel` (a model whose
    class has a `converted` property), which must have seen a batch
    (`caller` names the function in errors).

    Example:
        ```python
        graph_model(plugin, "kip.plot_model") is plugin.converted
        # -> True
        ```
    """
    if isinstance(getattr(type(model), "converted", None), property):
        if model.converted is None:
            raise PassError(
                f"{caller}: the PluginModel `{model.name}` has not seen a "
                "batch yet, so it has no converted graph: call it once (`plugin(x)`, "
                "`plugin.predict(x)` or `plugin.fit(...)`) first.")
        return model.converted
    return model


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class KipFunctional(_compat.Functional):
    """A functional model that honours `training` values pinned by the code.

    Example:
        ```python
        converted = kip.convert_to_functional(model, x)
        isinstance(converted, kip.KipFunctional)
        # -> True
        converted.kip_pinned_training   # e.g. {"frozen_bn": False}
        ```
    """

    def __init__(
        self,
        *args,
        kip_pinned_training=None,
        kip_annotations=None,
        kip_node_annotations=None,
        kip_node_training=None,
        kip_stage_devices=None,
        kip_original_mask=MASK_ON_INPUTS,
        kip_layer_paths=None,
        kip_call_takes_training=True,
        kip_output_modes=None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if kip_output_modes is not None:
            check_output_modes(kip_output_modes, len(self.outputs), f"`{self.name}`",
                                ValueError)
            kip_output_modes = {"outputs": dict(kip_output_modes["outputs"]),
                                "none_means": kip_output_modes["none_means"]}
        # Not tracked: Keras would make its dicts `TrackedDict`s, and the
        # structure a call returns must be the original's own dicts.
        object.__setattr__(self, "kip_output_modes", kip_output_modes)
        self.kip_call_takes_training = kip_call_takes_training
        if kip_original_mask not in (MASK_ON_INPUTS, MASK_ABSENT, MASK_ARGUMENT):
            raise ValueError(f"Unknown kip_original_mask {kip_original_mask!r}.")
        self.kip_original_mask = kip_original_mask
        self.kip_pinned_training = dict(kip_pinned_training or {})
        # By Keras layer name: a file saved before annotations were saved
        # per call site, or a `ModeSwitch`'s mode (see `graph_of`).
        self.kip_saved_layer_annotations = {
            name: dict(values) for name, values in (kip_annotations or {}).items()
        }
        self.kip_node_annotations = None if kip_node_annotations is None else {
            path: dict(values) for path, values in kip_node_annotations.items()
        }
        self.kip_node_training = None if kip_node_training is None else dict(kip_node_training)
        self.kip_stage_devices = list(kip_stage_devices or [])
        self.kip_layer_paths = dict(kip_layer_paths or {})
        self.kip_report = None
        self.kip_graph = None
        # (old layer, new layer) pairs made by Replace; not tracked, so the
        # replaced layers' variables are not this model's
        object.__setattr__(self, "kip_replaced", ())
        self._kip_executor = None
        self._kip_read_graph = None

    @property
    def kip_annotations(self):
        """`{Keras layer name: annotations}`: the nodes' annotations as the
        backends see them, by the name the Keras model calls each layer
        (the notes of a layer's call sites merged). Read-only: the nodes of
        `kip_graph` hold them, per call site.

        Example:
            ```python
            kip.apply_passes(converted, [Recompute("head")]).kip_annotations
            # -> {'head': {'recompute': True}}
            ```
        """
        found = {}
        for node in graph_of(self).nodes:
            if node.annotations:
                name = self.kip_layer_paths.get(node.name) or getattr(
                    node.operation, "name", node.name)
                found.setdefault(name, {}).update(node.annotations)
        return found

    @property
    def kip_call_takes_training(self):
        """Whether the `call` of the model this graph was converted from has a
        `training` argument.

        Keras's `fit` calls a model whose `call` has none as `model(x)`, not
        `model(x, training=True)`, so its Dropout layers and the like run in
        inference mode unless a caller says otherwise; the converted model is
        fitted the same way (its own `call` takes `training`, which would
        otherwise make `fit` train with them on).

        Example:
            ```python
            kip.convert_to_functional(model, x).kip_call_takes_training
            # -> False
            ```
        """
        return _compat.call_takes_training_argument(self)

    @kip_call_takes_training.setter
    def kip_call_takes_training(self, value):
        _compat.set_call_takes_training_argument(self, bool(value))

    def summary(self, line_length=None, positions=None, print_fn=None, expand_nested=False,
                show_trainable=False, layer_range=None):
        """The graph's nodes by path, with the class each really calls, its
        output shapes and parameters (`runtime/model_summary.py`); Keras's
        own summary where the model has no graph (a loaded model) or
        Keras's layout options are asked for."""
        # `line_length`: the table is as wide as the terminal, as Keras's.
        if self.kip_graph is None or expand_nested or positions or layer_range:
            return super().summary(line_length, positions, print_fn, expand_nested,
                                   show_trainable, layer_range)
        from keras_ipu_plugin.runtime.model_summary import summary_text

        text = summary_text(self, self.kip_graph, show_trainable=show_trainable)
        (print_fn or _compat.print_msg)(text)

    @property
    def kip_stages(self):
        """`{node path: pipeline stage}` from the PipelineStages pass.

        Example:
            ```python
            staged.kip_stages
            # -> {'stem': 0, 'blocks.0': 0, 'blocks.1': 1, 'head': 1}
            ```
        """
        return {node.name: node.annotations["stage"] for node in graph_of(self).nodes
                if "stage" in node.annotations}

    @property
    def kip_layer_stages(self):
        """`{Keras layer name: pipeline stage}`: the stages as the backends
        assign them, to the Keras model's layers."""
        return {
            name: notes["stage"]
            for name, notes in self.kip_annotations.items()
            if "stage" in notes
        }

    def kip_layer(self, path):
        """The layer at node path `path` (its attribute path from the model,
        `"blocks.1.dense"`), whatever name the Keras model shows for it (its
        own, `dense`, unless that name is taken, then an alias named after
        the path); a block Expand inlined is found by its path too. A
        layer's Keras name is accepted where it is no path (an alias).

        Example:
            ```python
            passed = kip.apply_passes(converted, [kip.passes.Expand()])
            passed.kip_layer("blocks.1.dense") is model.blocks[1].dense
            # -> True
            ```
        """
        name = self.kip_layer_paths.get(path, path)
        for layer in self.layers:
            if layer.name == name:
                return getattr(layer, "aliased_layer", layer)
        graph = self.kip_graph
        blocks = [block for node in (graph.nodes if graph is not None else ())
                  for block in node.from_blocks]
        for block in blocks:
            if block.path == path:
                return block.layer
        for block in blocks:  # an expanded block by its Keras name
            if block.layer.name == path:
                return block.layer
        for layer in self.layers:  # inside a layer's `training` modes (`ModeSwitch`)
            for mode in (layer.mode_outputs if _is_mode_switch(layer) else ()):
                try:
                    return layer.mode_model(mode).kip_layer(path)
                except ValueError:
                    continue
        known = list(self.kip_layer_paths) or [layer.name for layer in self.layers]
        raise ValueError(
            f"`{self.name}` has no layer at path {path!r} (paths such as: "
            f"{', '.join(known[:8])}{', ...' if len(known) > 8 else ''})."
        )

    def kip_interpreter(self):
        """The `Interpreter` that runs this model's graph on the backend in
        use: made on the first call, and again when `kip_stage_devices` or
        the annotations of the graph's nodes have changed since.

        Example:
            ```python
            passed.kip_interpreter().steps[0].recompute
            # -> True
            ```
        """
        from keras_ipu_plugin.runtime.backends import get_backend

        graph = graph_of(self)
        key = (tuple(self.kip_stage_devices), repr([node.annotations for node in graph.nodes]))
        if self._kip_executor is None or self._kip_executor[0] != key:
            # Not tracked by Keras: the interpreter holds no state of its own.
            object.__setattr__(self, "_kip_executor", (key, interpreter_for(self, get_backend())))
        return self._kip_executor[1]

    def call(self, inputs, training=None, mask=None, **kwargs):
        return self._in_mode_structure(self._call(inputs, training, mask, **kwargs), training)

    def compute_output_spec(self, inputs, training=None, mask=None):
        return self._in_mode_structure(
            super().compute_output_spec(inputs, training=training, mask=mask), training)

    def _in_mode_structure(self, outputs, training):
        """`outputs` (the flat outputs of every mode, where the original
        returns another structure in each `training` mode) as the structure
        of the mode `training` runs; as they are otherwise."""
        modes = self.kip_output_modes
        if modes is None:
            return outputs
        if training is None:
            mode = modes["none_means"]
        elif isinstance(training, bool):
            mode = "training" if training else "inference"
        else:
            raise TypeError(
                f"`{self.name}` returns another structure in training than in inference, "
                "as the model it was converted from does: it needs a Python True / False / "
                f"None as `training`, not {type(training).__name__} {training!r}.")
        flat = keras.tree.flatten(outputs)
        return keras.tree.map_structure(lambda index: flat[index], modes["outputs"][mode])

    def _call(self, inputs, training=None, mask=None, **kwargs):
        check_dtype_kinds(self.name, self.inputs, self._leaves_in_input_order(inputs))
        mask = self._mask_to_apply(inputs, mask)
        context = dict(kwargs, training=training)
        interpreter = self.kip_interpreter()
        inputs = _compat.standardize_inputs(self, inputs)
        if mask is not None:
            for x, one_mask in zip(inputs, keras.tree.flatten(mask)):
                if one_mask is not None:
                    _compat.set_keras_mask(x, one_mask)
        outputs = interpreter(inputs, training, context)
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]
        return outputs

    def _leaves_in_input_order(self, inputs):
        """The leaves of `inputs` in the order of `self.inputs`, matched the
        way Keras matches them (a dict by name where the model's inputs are
        not a dict); [] when they do not match (Keras then says why)."""
        if isinstance(inputs, dict) and not isinstance(self.input, dict):
            if all(tensor.name in inputs for tensor in self.inputs):
                return [inputs[tensor.name] for tensor in self.inputs]
            return []
        leaves = keras.tree.flatten(inputs)
        return leaves if len(leaves) == len(self.inputs) else []

    def _mask_to_apply(self, inputs, mask):
        """`mask`, when this graph applies it as the original model would;
        otherwise a `TypeError` that says why (never a silently other result)."""
        given = [m for m in keras.tree.flatten(mask) if m is not None] if mask is not None else []
        if not given or self.kip_original_mask == MASK_ON_INPUTS:
            return mask
        if self.kip_original_mask == MASK_ABSENT:
            carried = {id(_compat.keras_mask(leaf)) for leaf in keras.tree.flatten(inputs)}
            if all(id(m) in carried for m in given):
                # Keras passes on the masks the inputs already carry: the
                # original's sub-layers would read them from the inputs too.
                return mask
            raise TypeError(
                f"`mask` was passed to `{self.name}`, but the `call` of the model it "
                "was converted from takes no `mask` argument (the original model "
                "rejects it too). Attach the mask to the inputs with a masking "
                "layer, or pass it as an input of the model."
            )
        raise TypeError(
            f"`mask` was passed to `{self.name}`, whose graph was traced from the "
            "original model's `call` without a mask: `call` receives `mask` as an "
            "argument and may use it in any way, which this graph cannot "
            "reproduce. Call the original model with the mask, or train through "
            "kip.PluginModel, which converts the call with its mask."
        )

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        refuse_hdf5(self, filepath, zipped)
        return super().save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def get_config(self):
        # `keras.saving.save_model(model, "m.h5")` does not go through `save`.
        refuse_hdf5(self)
        refuse_state_shared_across_switches(self)
        config = super().get_config()
        config["kip_original_mask"] = self.kip_original_mask
        config["kip_pinned_training"] = dict(self.kip_pinned_training)
        graph = graph_of(self)
        config["kip_node_annotations"] = {
            node.name: dict(node.annotations) for node in graph.nodes if node.annotations
        }
        config["kip_node_training"] = {
            node.name: node.training for node in graph.nodes if node.training in (True, False)
        }
        config["kip_stage_devices"] = list(self.kip_stage_devices)
        config["kip_layer_paths"] = dict(self.kip_layer_paths)
        config["kip_call_takes_training"] = self.kip_call_takes_training
        if self.kip_output_modes is not None:
            config["kip_output_modes"] = self.kip_output_modes
        # A variable two layers hold (a conv's kernel and its write node) is
        # loaded as one (`layers/state.py`).
        mark_shared_variables(self, config)
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        entry = f"KipFunctional `{config.get('name')}`"
        check_saved_entries(config, entry)
        model = super().from_config(config, custom_objects=custom_objects)
        link_shared_variables(model, entry)
        try:
            graph_of(model)  # each saved annotation on its call site, or refused now
        except ValueError as error:
            raise LoadError(f"{entry}: {error}") from None
        return model


def refuse_state_shared_across_switches(model):
    """Raise `ValueError` before saving `model` where a variable (a weight,
    a seed generator's state) is used both inside a switch and outside it,
    or in two switches: each switch's body is saved as a model of its own,
    so loading would make two variables of it, and the loaded model would
    train (or draw) differently from the one saved. In memory it is one
    variable, as in the original model.

    Example:
        ```python
        refuse_state_shared_across_switches(passed)   # before passed.save(...)
        ```
    """
    owners = {}

    def claim(variable, owner):
        known = owners.setdefault(id(variable), owner)
        if known != owner:
            raise ValueError(
                f"`{model.name}` cannot be saved: the variable `{variable.path}` is used "
                f"by {known} and by {owner}. A layer whose `call` branches on `training` "
                "is held as one node with the graph of each mode, saved as a model of its "
                "own: a variable it shares with the rest of the model (a layer or a seed "
                "generator used at two call sites) would be loaded as two. Save the "
                "weights (`save_weights`), or save the model before Expand.")

    def visit(functional, owner):
        for layer in functional.layers:
            layer = getattr(layer, "aliased_layer", layer)
            if _is_mode_switch(layer):
                visit(layer.body, f"the modes of `{layer.name}`")
                continue
            for variable in layer.variables:  # seed generators' states too
                claim(variable, owner)

    visit(model, f"`{model.name}` outside its layers' training modes")


def _is_mode_switch(layer):
    """A `mode_switch.ModeSwitch` (told by what it holds: that module
    imports this one)."""
    return isinstance(getattr(layer, "body", None), KipFunctional) and hasattr(
        layer, "mode_outputs")
