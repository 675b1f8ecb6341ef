"""A STAND-IN FOR GRAPHCORE'S POPLAR SDK, written for this project's tests.

This is NOT Graphcore's SDK and runs nothing on an IPU: there is no IPU and
no Poplar SDK on the machines these tests run on, and the SDK (TensorFlow
2.6.3 with Graphcore's Keras 2.6 fork) could not import this Keras 3 library
anyway. It imitates, on CPU and in Keras 3, the signatures and argument
conventions of the SDK 3.4 modules the IPU backend calls, and it FAILS WHERE
THEY WOULD FAIL (in a few places earlier, said below), so that a backend
call the SDK would refuse fails here too. It was written from reading
(not copying) Graphcore's code, branch r2.6/sdk-release-3.4:

graphcore/tensorflow, tensorflow/python/ipu/
- ops/functional_ops.py `outlined_function(func=None, unique_sharding=False,
  keep_input_layouts=None, name=None)`: `func_wrapper(*args)` takes
  positional arguments only, each converted to a tensor. Here a list, tuple,
  dict or None argument raises TypeError (the SDK would fail converting it,
  or silently pack a list of same-shaped tensors into one tensor).
- ops/pipelining_ops.py `recomputation_checkpoint(tensors, name=None)`,
  `RecomputationMode`, `PipelineSchedule`.
- config.py `IPUConfig`: unknown attributes raise ValueError, values are
  type-checked strictly (TypeError); `configure_ipu_system()`.
- ipu_strategy.py `IPUStrategyV1` (alias `IPUStrategy`). The SDK's strategy
  places variables on /device:IPU:0, which exists only once the system is
  configured; here entering its scope before `configure_ipu_system()` raises.

graphcore/keras, keras/ (Graphcore's fork of Keras 2.6)
- engine/base_layer.py `_patch_keras_extension`: a model created inside an
  IPUStrategy scope gets Graphcore's extension class mixed in; `fit` /
  `evaluate` / `predict` then run the extension's versions.
- ipu/extensions/functional_extensions.py: `get_pipeline_stage_assignment`,
  `set_pipeline_stage_assignment` (validated: one assignment per call in post
  order, a stage for each, stages following the data flow),
  `set_pipelining_options`, `set_gradient_accumulation_options`,
  `_validate_call_function` (a pipelined model may not override `call`).
- ipu/extensions/pipeline_stage_assignment.py: the assignment classes; a
  nested model's assignment has no `.layer`.
- ipu/extensions/extensions_base.py: `fit` builds its own train function and
  never reads `model.train_function`; RuntimeError when `make_train_function`
  or `train_step` is overridden or `run_eagerly`; ValueError for a pipelined
  model without `gradient_accumulation_steps_per_replica`; RuntimeError when
  `steps_per_execution` is not a multiple of it.
- ipu/extensions/data_adapter.py: ValueError for dataset elements without a
  fully defined shape and for a partial last batch.

graphcore/ipu_tensorflow_addons, keras/layers/
- dropout.py `Dropout(rate, noise_shape=None, seed=None)` (seed: a pair).
- normalization.py `LayerNormalization(...)`: NotImplementedError for
  regularizers / constraints; ValueError for dimensions not fully specified.
- embedding_lookup.py `Embedding(...)`: NotImplementedError for mask_zero,
  regularizers, constraint, input_length; input of rank 2.
- dense.py `SerialDense(units, serialization_factor, serialization_dimension, ...)`.
- rnn.py `PopnnLSTM` / `PopnnGRU`: the constructor's ValueErrors, the
  accepted activations, weights `kernel`, `recurrent_kernel`, `biases` in
  Keras's gate order, NotImplementedError for a mask, and
  `call(inputs, mask=None, training=None, initial_state=None)`.
The layers compute what the addons layers document, with TensorFlow ops.

`install(monkeypatch)` puts the modules in `sys.modules` and imitates the
Keras fork's hooks on Keras 3 (a model created under the stand-in
IPUStrategy gets the extension; `Model.fit` / `evaluate` / `predict` defer to
it), for one test only; `recorder.calls` lists what was called, with what.
"""

import copy
import enum
import sys
import types

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
from keras.src.layers.layer import Layer as KerasLayer


class Recorder:
    """What the code under test called: `(name, details)` tuples."""

    def __init__(self):
        self.calls = []

    def record(self, name, *details):
        self.calls.append((name, *details))

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


class _State:
    configured = None  # the IPUConfig given to configure_ipu_system


# -- tensorflow.python.ipu -----------------------------------------------------------


def _tensor_like(value):
    if isinstance(value, (list, tuple, dict)) or value is None:
        return False
    return tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic, int, float, tf.Variable))


def _make_ipu(recorder, state):
    ipu = types.ModuleType("tensorflow.python.ipu")

    def outlined_function(func=None, unique_sharding=False, keep_input_layouts=None, name=None):
        if not isinstance(unique_sharding, bool):
            raise TypeError(f"unique_sharding must be a bool; got {unique_sharding!r}")
        name = name if name else "function"

        def decorated(inner):
            def func_wrapper(*args):
                for index, arg in enumerate(args):
                    if not _tensor_like(arg):
                        raise TypeError(
                            f"outlined_function `{name}`: argument {index} is a "
                            f"{type(arg).__name__}; every argument must be a "
                            "tf.Tensor-like object, passed positionally.")
                recorder.record("outlined_function",
                                {"unique_sharding": unique_sharding,
                                 "keep_input_layouts": keep_input_layouts, "name": name},
                                [tuple(tf.convert_to_tensor(a).shape) for a in args])
                with tf.name_scope(name):
                    outputs = inner(*[tf.convert_to_tensor(a) for a in args])
                if not any(tf.is_tensor(o) for o in tf.nest.flatten(outputs)):
                    raise ValueError("The function provided must return at least one tensor.")
                return outputs

            return func_wrapper

        return decorated(func) if func is not None else decorated

    class RecomputationMode(enum.Enum):
        Auto = 0
        RecomputeThenBackpropagate = 1
        RecomputeAndBackpropagateInterleaved = 2

    class PipelineSchedule(enum.Enum):
        Grouped = 0
        Interleaved = 1
        Sequential = 2

    def recomputation_checkpoint(tensors, name=None):
        recorder.record("recomputation_checkpoint",
                        [tuple(t.shape) for t in tf.nest.flatten(tensors)])
        return tf.nest.map_structure(tf.identity, tensors)

    class IPUConfig:
        _types = {
            "allow_recompute": lambda v: type(v) is bool,
            "auto_select_ipus": lambda v: type(v) is int or (
                type(v) in (list, tuple) and all(type(x) is int for x in v)),
            "select_ipus": lambda v: type(v) is int or (
                type(v) in (list, tuple) and all(type(x) is int for x in v)),
        }

        def __init__(self):
            object.__setattr__(self, "allow_recompute", False)
            object.__setattr__(self, "auto_select_ipus", [])
            object.__setattr__(self, "select_ipus", [])

        def __setattr__(self, key, value):
            if key not in self._types:
                raise ValueError(f"'{key}' is not a valid attribute of this config.")
            if not self._types[key](value):
                raise TypeError(f"Trying to set {key} to {value!r}, but it has the wrong type")
            object.__setattr__(self, key, value)

        def configure_ipu_system(self, device="cpu"):
            configure_ipu_system(self, device)

    def configure_ipu_system(config, device="cpu", reset_configuration=True):
        if config.auto_select_ipus and config.select_ipus:
            raise Exception("Only one of `auto_select_ipus` and `select_ipus` can be set.")
        snapshot = {"allow_recompute": config.allow_recompute,
                    "auto_select_ipus": config.auto_select_ipus}
        recorder.record("configure_ipu_system", snapshot)
        state.configured = snapshot

    class IPUStrategyV1(tf.distribute.OneDeviceStrategy):
        def __init__(self, ipu_device="/device:IPU:0", cpu_device="/device:CPU:0",
                     enable_dataset_iterators=True, enable_keras_extensions=True):
            super().__init__("/cpu:0")
            self._enable_keras_extensions = enable_keras_extensions
            recorder.record("IPUStrategy", ipu_device)

        def scope(self):
            if state.configured is None:
                raise RuntimeError(
                    "IPUStrategy: no IPU device /device:IPU:0 (the IPU system is not "
                    "configured: call IPUConfig().configure_ipu_system() first).")
            return super().scope()

        def _patch_keras_extension(self, instance):
            if not self._enable_keras_extensions or isinstance(instance, ModelExtension):
                return
            extension = FunctionalExtension if _is_functional(instance) else ModelExtension
            cls = type(instance)
            instance.__class__ = type(cls.__name__, (cls, extension), {})
            extension._extension_init(instance, recorder)

    ipu.outlined_function = outlined_function
    ipu.pipelining_ops = types.SimpleNamespace(
        recomputation_checkpoint=recomputation_checkpoint,
        RecomputationMode=RecomputationMode, PipelineSchedule=PipelineSchedule)
    ipu.config = types.SimpleNamespace(IPUConfig=IPUConfig, configure_ipu_system=configure_ipu_system)
    ipu.ipu_strategy = types.SimpleNamespace(IPUStrategyV1=IPUStrategyV1, IPUStrategy=IPUStrategyV1)
    return ipu


def _is_functional(model):
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


# -- keras.ipu extensions (Graphcore's Keras fork) ---------------------------------------


class FunctionalLayerPipelineStageAssignment:
    def __init__(self, layer, node_index, pipeline_stage=None):
        self._layer, self._node_index = layer, node_index
        self.pipeline_stage = pipeline_stage

    layer = property(lambda self: self._layer)
    node_index = property(lambda self: self._node_index)
    is_nested_model = property(lambda self: False)


class FunctionalNestedModelPipelineStageAssignment:
    def __init__(self, nested_model, node_index, pipeline_stage_assignments):
        self._nested_model, self._node_index = nested_model, node_index
        self._assignments = pipeline_stage_assignments

    nested_model = property(lambda self: self._nested_model)
    node_index = property(lambda self: self._node_index)
    pipeline_stage_assignments = property(lambda self: list(self._assignments))
    is_nested_model = property(lambda self: True)


_FUNCTIONS = {"fit": ("train_function", "make_train_function", "train_step"),
              "evaluate": ("test_function", "make_test_function", "test_step"),
              "predict": ("predict_function", "make_predict_function", "predict_step")}


def _own_function_property(attribute):
    """Graphcore's fit builds its own function: what others assign to
    `model.<attribute>` is kept aside, never run."""

    def get(self):
        return self.__dict__.get("_standin_own", {}).get(attribute)

    def set_(self, value):
        if self.__dict__.get("_standin_building"):
            self.__dict__.setdefault("_standin_own", {})[attribute] = value
        else:
            self.__dict__.setdefault("_standin_ignored", {})[attribute] = value

    return property(get, set_)


class ModelExtension:
    """Graphcore's extension of a (subclassed) Keras model, as far as the
    backend meets it: its fit / evaluate / predict."""

    train_function = _own_function_property("train_function")
    test_function = _own_function_property("test_function")
    predict_function = _own_function_property("predict_function")

    @staticmethod
    def _extension_init(instance, recorder):
        instance.__dict__["_standin_recorder"] = recorder
        instance.__dict__["_standin_assignment"] = []
        instance.__dict__["_standin_pipelining"] = None
        instance.__dict__["_standin_accumulation"] = None

    def _is_pipelined(self):
        return bool(self.__dict__["_standin_assignment"])

    def _graphcore_run(self, method, keras_method, args, kwargs):
        attribute, maker, step = _FUNCTIONS[method]
        if self.run_eagerly:
            raise RuntimeError("Keras models cannot run eagerly when using `IPUStrategy`.")
        for name in (maker, step):
            if getattr(type(self), name) is not getattr(keras.Model, name):
                raise RuntimeError(
                    f"The function `{name}` for the model {self.name} has been "
                    "overridden. This is not supported when using Keras within an "
                    "IPUStrategy.")
        if self._is_pipelined() and type(self).call is not _functional_call():
            raise RuntimeError(
                f"The function `call` for the model {self.name} has been overridden. "
                "This is not supported for pipelined Keras Functional models.")
        if method == "fit":
            self._check_accumulation()
        _check_data(keras_method, self, args, kwargs)
        self.__dict__["_standin_recorder"].record(method, self.name)
        self.__dict__["_standin_building"] = True
        try:
            getattr(TensorFlowTrainer, maker)(self, force=True)
        finally:
            self.__dict__["_standin_building"] = False
        return keras_method(self, *args, **kwargs)

    def _check_accumulation(self):
        pipelining = self.__dict__["_standin_pipelining"]
        if self._is_pipelined():
            steps = None if pipelining is None else pipelining["gradient_accumulation_steps_per_replica"]
            if steps is None:
                raise ValueError(
                    "The model which you are attempting to train is pipelined, however "
                    "`gradient_accumulation_steps_per_replica` has not been set through "
                    "`set_pipelining_options()`.")
        else:
            steps = self.__dict__["_standin_accumulation"]
        per_execution = getattr(self, "steps_per_execution", 1) or 1
        if steps and int(per_execution) % steps:
            raise RuntimeError(
                f"`steps_per_execution` ({per_execution}) is not divisible by "
                f"`gradient_accumulation_steps_per_replica` ({steps}).")

    def set_gradient_accumulation_options(
            self, gradient_accumulation_steps_per_replica=None,
            gradient_accumulation_reduction_method="sum",
            use_v2_gradient_accumulation_optimizer=False,
            **gradient_accumulation_optimizer_kwargs):
        steps = gradient_accumulation_steps_per_replica
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError("Expected `gradient_accumulation_steps_per_replica` to be a "
                             f"positive integer, but got {steps} instead.")
        for key in ("opt", "num_mini_batches"):
            if key in gradient_accumulation_optimizer_kwargs:
                raise ValueError(f"Found `{key}` key in `gradient_accumulation_optimizer_kwargs`.")
        self.__dict__["_standin_accumulation"] = steps
        self.__dict__["_standin_recorder"].record(
            "set_gradient_accumulation_options", self.name,
            {"gradient_accumulation_steps_per_replica": steps})


def _functional_call():
    from keras.src.models.functional import Functional

    return Functional.call


class FunctionalExtension(ModelExtension):
    """Graphcore's FunctionalExtension: the pipeline stage API."""

    def _post_order(self):
        nodes = []
        for depth in sorted(self._nodes_by_depth, reverse=True):
            nodes.extend(n for n in self._nodes_by_depth[depth]
                         if n.operation is not None and not n.is_input)
        return nodes

    def get_pipeline_stage_assignment(self):
        if self.__dict__["_standin_assignment"]:
            return copy.copy(self.__dict__["_standin_assignment"])
        found = []
        for node in self._post_order():
            operation = node.operation
            index = operation._inbound_nodes.index(node)
            if isinstance(operation, FunctionalExtension):
                found.append(FunctionalNestedModelPipelineStageAssignment(
                    operation, index, operation.get_pipeline_stage_assignment()))
            else:
                found.append(FunctionalLayerPipelineStageAssignment(operation, index))
        return found

    def set_pipeline_stage_assignment(self, pipeline_stage_assignment):
        nodes = self._post_order()
        if not isinstance(pipeline_stage_assignment, list):
            raise ValueError("`pipeline_stage_assignment` needs to be a list.")
        if len(pipeline_stage_assignment) != len(nodes):
            raise ValueError(
                f"The length of the provided `pipeline_stage_assignment` "
                f"({len(pipeline_stage_assignment)}) does not match the number of "
                f"layers in the graph ({len(nodes)}).")
        stage_of_output = {}
        for assignment, node in zip(pipeline_stage_assignment, nodes):
            stages = _stages_of(assignment, node, self.name)
            inputs = [stage_of_output[id(t)] for t in node.input_tensors if id(t) in stage_of_output]
            if inputs and min(stages) < max(inputs):
                raise ValueError(
                    f"Layer {node.operation.name} in pipeline stage {min(stages)} has a "
                    "dependency from a pipeline stage which has not yet been executed.")
            for tensor in node.output_tensors:
                stage_of_output[id(tensor)] = max(stages)
        self.__dict__["_standin_assignment"] = list(pipeline_stage_assignment)
        self.__dict__["_standin_recorder"].record(
            "set_pipeline_stage_assignment", self.name,
            [_describe(a) for a in pipeline_stage_assignment])

    def set_pipelining_options(self, gradient_accumulation_steps_per_replica=None,
                               device_mapping=None, accumulate_outfeed=None,
                               gradient_accumulation_reduction_method="sum",
                               **pipelining_kwargs):
        steps = gradient_accumulation_steps_per_replica
        if steps is not None and (not isinstance(steps, int) or steps < 1):
            raise ValueError("Expected `gradient_accumulation_steps_per_replica` to be a "
                             f"positive integer, but got {steps} instead.")
        if device_mapping is not None and not (
                isinstance(device_mapping, list) and all(isinstance(x, int) for x in device_mapping)):
            raise ValueError("Expected `device_mapping` to be a list of integers.")
        for key in ("gradient_accumulation_count", "device_mapping", "accumulate_outfeed",
                    "computational_stages", "repeat_count", "inputs", "infeed_queue",
                    "outfeed_queue", "optimizer_function", "outfeed_loss", "outfeed_mask",
                    "batch_serialization_iterations"):
            if key in pipelining_kwargs:
                raise ValueError(f"Found `{key}` key in `pipelining_kwargs`.")
        known = {"recomputation_mode", "pipeline_schedule", "forward_propagation_stages_poplar_options",
                 "backward_propagation_stages_poplar_options", "offload_weight_update_variables",
                 "replicated_optimizer_state_sharding", "offload_activations", "name",
                 "gradient_accumulation_dtype", "weight_update_poplar_options",
                 "offload_gradient_accumulation_buffers", "replicated_weight_sharding",
                 "offload_weights", "continuous_weight_updates", "accumulate_outfeed_dtype"}
        unknown = sorted(set(pipelining_kwargs) - known)
        if unknown:  # forwarded to pipelining_ops.pipeline, which has no such argument
            raise TypeError(f"pipeline() got an unexpected keyword argument '{unknown[0]}'")
        mode = pipelining_kwargs.get("recomputation_mode")
        if mode is not None and type(mode).__name__ != "RecomputationMode":
            raise TypeError(f"recomputation_mode must be a RecomputationMode; got {mode!r}")
        assignment = self.__dict__["_standin_assignment"]
        if device_mapping is not None and assignment:
            # pipelining_ops.pipeline checks this when fit builds the pipeline.
            count = max(max(_flat_stages(a)) for a in assignment) + 1
            if len(device_mapping) != count:
                raise ValueError(f"device_mapping has {len(device_mapping)} entries for {count} stages.")
        options = {"gradient_accumulation_steps_per_replica": steps,
                   "device_mapping": device_mapping, **pipelining_kwargs}
        self.__dict__["_standin_pipelining"] = options
        self.__dict__["_standin_recorder"].record("set_pipelining_options", self.name, options)


def _flat_stages(assignment):
    if assignment.is_nested_model:
        return [s for inner in assignment.pipeline_stage_assignments for s in _flat_stages(inner)]
    return [assignment.pipeline_stage]


def _stages_of(assignment, node, model_name):
    if isinstance(node.operation, FunctionalExtension):
        if not isinstance(assignment, FunctionalNestedModelPipelineStageAssignment):
            raise ValueError(
                f"The pipeline stage assignment for nested model {node.operation.name} in "
                f"{model_name} must be an instance of "
                "`FunctionalNestedModelPipelineStageAssignment`.")
        if assignment.nested_model is not node.operation:
            raise ValueError("The order of `pipeline_stage_assignment` does not match the post-order.")
    else:
        if not isinstance(assignment, FunctionalLayerPipelineStageAssignment):
            raise ValueError(
                f"The pipeline stage assignment for layer {node.operation.name} in "
                f"{model_name} must be an instance of `FunctionalLayerPipelineStageAssignment`.")
        if assignment.layer is not node.operation:
            raise ValueError("The order of `pipeline_stage_assignment` does not match the post-order.")
    stages = _flat_stages(assignment)
    if any(stage is None for stage in stages):
        raise ValueError(
            f"Layer {node.operation.name} with node_index {assignment.node_index} has "
            "not been assigned a pipeline stage in `pipeline_stage_assignment`.")
    return stages


def _describe(assignment):
    if assignment.is_nested_model:
        return (assignment.nested_model.name, assignment.node_index,
                [_describe(a) for a in assignment.pipeline_stage_assignments])
    return (assignment.layer.name, assignment.node_index, assignment.pipeline_stage)


def _check_data(keras_method, model, args, kwargs):
    """Graphcore's data adapter: shapes known ahead of time, no partial batch."""
    import inspect

    bound = inspect.signature(keras_method).bind(model, *args, **kwargs).arguments
    x, batch_size = bound.get("x"), bound.get("batch_size")
    if isinstance(x, tf.data.Dataset):
        for spec in tf.nest.flatten(x.element_spec):
            if not spec.shape.is_fully_defined():
                raise ValueError(
                    f"The provided set of data contains a shape {spec.shape} which is not "
                    "fully defined. ... make sure to set `drop_remainder=True`.")
        return
    leaves = tf.nest.flatten(x)
    if leaves and int(leaves[0].shape[0]) % (batch_size or 32):
        raise ValueError("The provided set of data has a partial batch.")


# -- ipu_tensorflow_addons.keras.layers ------------------------------------------------------


def _check_unsupported(layer, value, name, method="__init__"):
    if value:
        raise NotImplementedError(
            f"ipu_tensorflow_addons.keras.layers.{type(layer).__name__} does not support "
            f"{method} argument {name}.")


def _is_seed_pair(seed):
    return isinstance(seed, (list, tuple, np.ndarray)) and len(seed) == 2


class Dropout(keras.layers.Layer):
    def __init__(self, rate, noise_shape=None, seed=None, **kwargs):
        self.ref = kwargs.pop("ref", True)
        super().__init__(**kwargs)
        self.rate, self.noise_shape, self.seed = rate, noise_shape, seed

    def call(self, inputs, training=None):
        if not training:
            return tf.identity(inputs)
        if self.seed is not None and not _is_seed_pair(self.seed):
            raise ValueError(f"Dropout seed must be a pair of int32; got {self.seed!r}.")
        seed = self.seed if self.seed is not None else tf.random.uniform([2], maxval=2**31 - 1, dtype="int32")
        return tf.nn.experimental.stateless_dropout(
            inputs, self.rate, seed=tf.cast(seed, "int32"), noise_shape=self.noise_shape)

    def get_config(self):
        return {"rate": self.rate, "noise_shape": self.noise_shape, "seed": self.seed, "ref": self.ref}


class LayerNormalization(keras.layers.Layer):
    def __init__(self, axis=-1, epsilon=1e-3, center=True, scale=True,
                 beta_initializer="zeros", gamma_initializer="ones", beta_regularizer=None,
                 gamma_regularizer=None, beta_constraint=None, gamma_constraint=None,
                 trainable=True, **kwargs):
        super().__init__(trainable=trainable, **kwargs)
        for name, value in (("beta_regularizer", beta_regularizer), ("gamma_regularizer", gamma_regularizer),
                            ("beta_constraint", beta_constraint), ("gamma_constraint", gamma_constraint)):
            _check_unsupported(self, value, name)
        self.axis = list(axis) if isinstance(axis, (list, tuple)) else [axis]
        self.epsilon, self.center, self.scale = epsilon, center, scale
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)

    def build(self, input_shape):
        ndims = len(input_shape)
        self.axis = sorted(a % ndims for a in self.axis)
        if any(input_shape[a] is None for a in self.axis):
            raise ValueError(f"Input shape {input_shape} has unknown dimensions - all "
                             "dimensions need to be fully specified.")
        shape = [input_shape[a] for a in self.axis]
        self.gamma = self.beta = None
        if self.scale:
            self.gamma = self.add_weight(shape=shape, initializer=self.gamma_initializer, name="gamma")
        if self.center:
            self.beta = self.add_weight(shape=shape, initializer=self.beta_initializer, name="beta")

    def call(self, inputs, training=None):
        others = [d for d in range(len(inputs.shape)) if d not in self.axis]
        if any(inputs.shape[d] is None for d in others):
            raise ValueError(f"Input shape {inputs.shape} has unknown dimensions - all "
                             "dimensions need to be fully specified.")
        mean, variance = tf.nn.moments(inputs, axes=self.axis, keepdims=True)
        outputs = (inputs - mean) * tf.math.rsqrt(variance + self.epsilon)
        if self.gamma is not None:
            outputs = outputs * self.gamma
        if self.beta is not None:
            outputs = outputs + self.beta
        return outputs


class Embedding(keras.layers.Layer):
    def __init__(self, input_dim, output_dim, embeddings_initializer="uniform",
                 embeddings_regularizer=None, activity_regularizer=None,
                 embeddings_constraint=None, mask_zero=False, input_length=None,
                 serialization_factor=1, **kwargs):
        kwargs["autocast"] = False
        super().__init__(**kwargs)
        for name, value in (("embeddings_regularizer", embeddings_regularizer),
                            ("activity_regularizer", activity_regularizer),
                            ("embeddings_constraint", embeddings_constraint),
                            ("mask_zero", mask_zero), ("input_length", input_length)):
            _check_unsupported(self, value, name)
        self.input_dim, self.output_dim = input_dim, output_dim
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.serialization_factor = serialization_factor

    def build(self, input_shape):
        if len(input_shape) != 2:
            raise ValueError("The input shape should be a tensor of shape [batch, input_length]")
        self.embeddings = self.add_weight(shape=(self.input_dim, self.output_dim),
                                          initializer=self.embeddings_initializer, name="embeddings")

    def call(self, inputs, inputs_are_sorted=False, training=None):
        return tf.gather(self.embeddings, tf.cast(inputs, "int32"))


_SERIAL_DIMENSIONS = ("input_columns", "input_rows_kernel_columns", "kernel_rows")


class SerialDense(keras.layers.Layer):
    def __init__(self, units, serialization_factor, serialization_dimension, activation=None,
                 use_bias=True, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 kernel_constraint=None, bias_constraint=None, **kwargs):
        super().__init__(activity_regularizer=activity_regularizer, **kwargs)
        self.units = int(units)
        self.serialization_factor = int(serialization_factor)
        self.serialization_dimension = serialization_dimension
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.bias_regularizer = keras.regularizers.get(bias_regularizer)

    def build(self, input_shape):
        self.kernel = self.add_weight(shape=(input_shape[-1], self.units), name="kernel",
                                      initializer=self.kernel_initializer,
                                      regularizer=self.kernel_regularizer)
        self.bias = self.add_weight(shape=(self.units,), name="bias", initializer=self.bias_initializer,
                                    regularizer=self.bias_regularizer) if self.use_bias else None

    def call(self, inputs):
        if self.serialization_factor < 1:
            raise ValueError("serialization_factor has to be at least 1, but was "
                             f"{self.serialization_factor}.")
        if self.serialization_dimension not in _SERIAL_DIMENSIONS:
            raise ValueError(f"Invalid serialization_dimension={self.serialization_dimension}")
        size = {"input_columns": inputs.shape[-2], "input_rows_kernel_columns": self.kernel.shape[0],
                "kernel_rows": self.units}[self.serialization_dimension]
        if size is not None and size % self.serialization_factor:
            raise ValueError(f"serialization_factor {self.serialization_factor} does not divide {size}.")
        outputs = tf.tensordot(inputs, self.kernel, 1)
        if self.bias is not None:
            outputs = outputs + self.bias
        return self.activation(outputs)


_ACTIVATIONS = ("tanh", "relu", "softmax", "sigmoid", "hard_sigmoid")
_RECURRENT_ACTIVATIONS = ("tanh", "softmax", "sigmoid", "hard_sigmoid")


def _activation_name(activation):
    if isinstance(activation, str):
        return activation
    return getattr(activation, "__name__", str(activation))


class _PopnnRNN(keras.layers.Layer):
    _gates = None
    _kind = None

    def __init__(self, units, activation="tanh", recurrent_activation="sigmoid", use_bias=True,
                 kernel_initializer="glorot_uniform", recurrent_initializer="orthogonal",
                 bias_initializer="zeros", kernel_regularizer=None, recurrent_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, kernel_constraint=None,
                 recurrent_constraint=None, bias_constraint=None, dropout=0., dropout_seed=None,
                 recurrent_dropout=0., implementation=2, return_sequences=False,
                 return_state=False, go_backwards=False, stateful=False, unroll=False,
                 partials_dtype=tf.float32, seed=None, time_major=False, options=None,
                 options_bwd=None, **kwargs):
        kind = self._kind
        if implementation == 2:
            implementation = 1
        if not use_bias:
            raise ValueError(f"IPU custom {kind} layer does not support use_bias = False.")
        for name, value in (("kernel_regularizer", kernel_regularizer),
                            ("recurrent_regularizer", recurrent_regularizer),
                            ("bias_regularizer", bias_regularizer),
                            ("activity_regularizer", activity_regularizer),
                            ("kernel_constraint", kernel_constraint),
                            ("recurrent_constraint", recurrent_constraint),
                            ("bias_constraint", bias_constraint)):
            if value:
                raise ValueError(f"IPU custom {kind} layer does not support {name}.")
        if recurrent_dropout != 0.:
            raise ValueError(f"IPU custom {kind} layer does not support recurrent_dropout.")
        if go_backwards:
            raise ValueError(f"IPU custom {kind} layer does not support go_backwards = True.")
        if unroll:
            raise ValueError(f"IPU custom {kind} layer does not support unroll = True.")
        super().__init__(**kwargs)
        if _activation_name(activation) not in _ACTIVATIONS:
            raise ValueError(f"IPU custom RNN layer does not support '{activation}' as an activation.")
        if _activation_name(recurrent_activation) not in _RECURRENT_ACTIVATIONS:
            raise ValueError(f"IPU custom RNN layer does not support '{recurrent_activation}' "
                             "as a recurrent activation.")
        self.units = units
        self.activation = keras.activations.get(activation)
        self.recurrent_activation = keras.activations.get(recurrent_activation)
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.recurrent_initializer = keras.initializers.get(recurrent_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.dropout, self.dropout_seed = dropout, dropout_seed
        self.return_sequences, self.return_state = return_sequences, return_state
        self.stateful, self.time_major = stateful, time_major

    def _bias_shape(self):
        return (self._gates * self.units,)

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise ValueError(f"Expecting input_shape with 3 dims, got {len(input_shape)}")
        if input_shape[-1] is None:
            raise ValueError("The last dimension of the inputs to `_PopnnRNN` should be defined.")
        self.kernel = self.add_weight(shape=(input_shape[-1], self._gates * self.units),
                                      initializer=self.kernel_initializer, name="kernel")
        self.recurrent_kernel = self.add_weight(shape=(self.units, self._gates * self.units),
                                                initializer=self.recurrent_initializer,
                                                name="recurrent_kernel")
        self.biases = self.add_weight(shape=self._bias_shape(), initializer=self.bias_initializer,
                                      name="biases")

    def call(self, inputs, mask=None, training=None, initial_state=None):
        _check_unsupported(self, mask is not None, "mask", "call")
        if len(inputs.shape) != 3:
            raise ValueError("inputs tensor must be 3D")
        sequence = inputs if self.time_major else tf.transpose(inputs, [1, 0, 2])
        if training and self.dropout > 0.:
            if self.dropout_seed is not None and not _is_seed_pair(self.dropout_seed):
                raise ValueError(f"dropout_seed must be a pair; got {self.dropout_seed!r}")
            seed = self.dropout_seed if self.dropout_seed is not None else [0, 0]
            shape = [1] + sequence.shape.as_list()[1:]
            sequence = tf.nn.experimental.stateless_dropout(
                sequence, self.dropout, seed=tf.cast(seed, "int32"), noise_shape=shape)
        outputs, final = self._run(sequence, initial_state, tf.shape(sequence)[1])
        if not self.time_major:
            outputs = tf.transpose(outputs, [1, 0, 2])
        output = outputs if self.return_sequences else final[0]
        if self.return_state:
            return (output, *final)
        return output


class PopnnLSTM(_PopnnRNN):
    _gates = 4
    _kind = "LSTM"

    def __init__(self, units, *args, unit_forget_bias=True, **kwargs):
        super().__init__(units, *args, **kwargs)
        self.unit_forget_bias = unit_forget_bias

    def _run(self, sequence, initial_state, batch):
        if initial_state is None:
            zeros = tf.zeros(tf.stack([batch, self.units]), sequence.dtype)
            initial_state = (zeros, zeros)
        h, c = initial_state

        def step(carry, x):
            h, c = carry
            z = tf.matmul(x, self.kernel) + tf.matmul(h, self.recurrent_kernel) + self.biases
            i, f, g, o = tf.split(z, 4, axis=-1)
            i, f, o = (self.recurrent_activation(t) for t in (i, f, o))
            c = f * c + i * self.activation(g)
            return o * self.activation(c), c

        hs, cs = tf.scan(step, sequence, initializer=(tf.convert_to_tensor(h), tf.convert_to_tensor(c)))
        return hs, (hs[-1], cs[-1])


class PopnnGRU(_PopnnRNN):
    _gates = 3
    _kind = "GRU"

    def __init__(self, units, *args, reset_after=True, **kwargs):
        super().__init__(units, *args, **kwargs)
        self.reset_after = reset_after

    def _bias_shape(self):
        return (2, 3 * self.units) if self.reset_after else (3 * self.units,)

    def _run(self, sequence, initial_state, batch):
        if initial_state is None:
            initial_state = tf.zeros(tf.stack([batch, self.units]), sequence.dtype)
        state = tf.convert_to_tensor(initial_state)
        kernel_z, kernel_r, kernel_h = tf.split(self.recurrent_kernel, 3, axis=1)

        def step(h, x):
            if self.reset_after:
                x_z, x_r, x_h = tf.split(tf.matmul(x, self.kernel) + self.biases[0], 3, axis=-1)
                r_z, r_r, r_h = tf.split(tf.matmul(h, self.recurrent_kernel) + self.biases[1], 3, axis=-1)
                z = self.recurrent_activation(x_z + r_z)
                r = self.recurrent_activation(x_r + r_r)
                candidate = self.activation(x_h + r * r_h)
            else:
                x_z, x_r, x_h = tf.split(tf.matmul(x, self.kernel) + self.biases, 3, axis=-1)
                z = self.recurrent_activation(x_z + tf.matmul(h, kernel_z))
                r = self.recurrent_activation(x_r + tf.matmul(h, kernel_r))
                candidate = self.activation(x_h + tf.matmul(r * h, kernel_h))
            return z * h + (1 - z) * candidate

        hs = tf.scan(step, sequence, initializer=state)
        return hs, (hs[-1],)


def _make_addons():
    layers = types.ModuleType("ipu_tensorflow_addons.keras.layers")
    for cls in (Dropout, LayerNormalization, Embedding, SerialDense, PopnnLSTM, PopnnGRU):
        setattr(layers, cls.__name__, cls)
    return layers


# -- installing it -------------------------------------------------------------------------


class StandIn:
    """The installed stand-in: `recorder`, `ipu` (the module), `addons`."""

    def __init__(self, recorder, ipu, addons, state):
        self.recorder, self.ipu, self.addons, self.state = recorder, ipu, addons, state

    def configure(self, num_ipus=1, allow_recompute=False):
        """What a user does first on an IPU machine."""
        config = self.ipu.config.IPUConfig()
        config.auto_select_ipus = num_ipus
        config.allow_recompute = allow_recompute
        config.configure_ipu_system()


def install(monkeypatch, with_addons=True):
    """Install the stand-in for one test (monkeypatch undoes it all)."""
    recorder, state = Recorder(), _State()
    ipu = _make_ipu(recorder, state)
    addons = _make_addons() if with_addons else None
    monkeypatch.setitem(sys.modules, "tensorflow.python.ipu", ipu)
    if with_addons:
        monkeypatch.setitem(sys.modules, "ipu_tensorflow_addons", types.ModuleType("ipu_tensorflow_addons"))
        monkeypatch.setitem(sys.modules, "ipu_tensorflow_addons.keras",
                            types.ModuleType("ipu_tensorflow_addons.keras"))
        monkeypatch.setitem(sys.modules, "ipu_tensorflow_addons.keras.layers", addons)
    else:
        monkeypatch.setitem(sys.modules, "ipu_tensorflow_addons.keras.layers", None)

    # Graphcore's Keras fork: Layer.__init__ patches models created in an
    # IPUStrategy scope (engine/base_layer.py `_patch_keras_extension`).
    original_init = KerasLayer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        strategy = tf.distribute.get_strategy()
        if isinstance(self, keras.Model) and isinstance(strategy, ipu.ipu_strategy.IPUStrategyV1):
            strategy._patch_keras_extension(self)

    monkeypatch.setattr(KerasLayer, "__init__", init)

    # ... and its Model.fit / evaluate / predict defer to the extension.
    for method in ("fit", "evaluate", "predict"):
        original = getattr(TensorFlowTrainer, method)

        def deferring(self, *args, __method=method, __original=original, **kwargs):
            if isinstance(self, ModelExtension):
                return self._graphcore_run(__method, __original, args, kwargs)
            return __original(self, *args, **kwargs)

        monkeypatch.setattr(TensorFlowTrainer, method, deferring)
    return StandIn(recorder, ipu, addons, state)
