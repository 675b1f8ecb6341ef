"""The IPU Replace preset: Keras layers -> `ipu_tensorflow_addons.keras.layers`.

Each addons layer has documented limits (graphcore/ipu_tensorflow_addons,
branch r2.6/sdk-release-3.4, keras/layers/*.py): what its constructor refuses
(NotImplementedError / ValueError), what it silently does differently, and
the shapes it needs. `IpuReplace` checks every matched layer and call against
them before building anything, and names the layer at fault:

- Dropout (dropout.py): `seed` is a pair of int32, not Keras's one int.
- LayerNormalization (normalization.py): no regularizers or constraints, no
  `rms_scaling`; every non-normalised dimension (the batch) must be static.
- Embedding (embedding_lookup.py): no `mask_zero`, regularizers or
  constraint; input of shape `(batch, length)`.
- PopnnLSTM / PopnnGRU (rnn.py): no masks, `use_bias=False`,
  regularizers, constraints, `recurrent_dropout`, `go_backwards`, `unroll`
  (and, here, `stateful`: state variables are not copied);
  activations among the few Popnn has; a dropout seed is a pair of int32;
  `call(inputs, mask, training, initial_state)`, so a second positional
  argument would bind to `mask`. Their weights are `kernel`,
  `recurrent_kernel` and `biases` (Keras: `bias`) in Keras's gate order and
  shapes: Graphcore's own tests copy them with
  `popnn_layer.set_weights(keras_layer.get_weights())` (rnn_test.py,
  `test_lstm_save_load_weights`, `test_gru_ipu_vs_cpu_results_reset_after`).
- SerialDense (dense.py): `serialization_factor` and
  `serialization_dimension` are required; the factor must divide the
  serialised dimension.

A mask or a dynamic shape reaching any of them is refused: the IPU needs
static shapes, and the addons layers either raise on a mask or drop it.

Example:
    ```python
    passed = kip.apply_passes(converted, kip.ipu_replacements())
    ```
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.passes.replace import Replace
from keras_ipu_plugin.passes.replace import Replacement
from keras_ipu_plugin.passes.expand import expand_to_reach
from keras_ipu_plugin.passes.infra.base import nodes_matching
from keras_ipu_plugin.runtime.backends import get_backend

#: Keras layer class name -> `ipu_tensorflow_addons.keras.layers` class name.
#: Dense -> SerialDense only when asked for (`serial_dense=True`): it changes
#: the memory / cycles trade-off rather than just the implementation.
IPU_REPLACEMENTS = {
    "Dropout": "Dropout",
    "LayerNormalization": "LayerNormalization",
    "Embedding": "Embedding",
    "LSTM": "PopnnLSTM",
    "GRU": "PopnnGRU",
}

#: SerialDense's `serialization_dimension` values (dense.py).
SERIALIZATION_DIMENSIONS = ("input_columns", "input_rows_kernel_columns", "kernel_rows")

# rnn.py: ACCEPTED_ACTIVATIONS / ACCEPTED_RECURRENT_ACTIVATIONS.
_POPNN_ACTIVATIONS = ("tanh", "relu", "softmax", "sigmoid", "hard_sigmoid")
_POPNN_RECURRENT_ACTIVATIONS = ("tanh", "softmax", "sigmoid", "hard_sigmoid")

# Keras -> Popnn weight names (rnn.py `_PopnnRNN._build`, `get_bias`).
_POPNN_WEIGHTS = {"kernel": "kernel", "recurrent_kernel": "recurrent_kernel", "bias": "biases"}


def ipu_replace(addons, serial_dense=False, serialization_factor=None,
                serialization_dimension=None):
    """The `IpuReplace` pass over the addons module `addons`.

    Example:
        ```python
        ipu_replace(addons, serial_dense=True, serialization_factor=4,
                    serialization_dimension="kernel_rows")
        ```
    """
    copiers = {
        "LayerNormalization": dict(copy_weights=True),
        "Embedding": dict(copy_weights=True),
        "LSTM": dict(copy_weights_fn=copy_rnn_weights),
        "GRU": dict(copy_weights_fn=copy_rnn_weights),
        "Dropout": {},  # no weights
    }
    mapping = {}
    for keras_name, addons_name in IPU_REPLACEMENTS.items():
        if hasattr(addons, addons_name):
            mapping[getattr(keras.layers, keras_name)] = Replacement(
                getattr(addons, addons_name), **copiers[keras_name])
    if serial_dense:
        mapping[keras.layers.Dense] = _serial_dense(addons, serialization_factor, serialization_dimension)
    elif serialization_factor is not None or serialization_dimension is not None:
        raise PassError(
            "ipu_replacements: serialization_factor / serialization_dimension are "
            "SerialDense arguments; pass serial_dense=True to replace Dense."
        )
    return IpuReplace(mapping)


def _serial_dense(addons, factor, dimension):
    if not hasattr(addons, "SerialDense"):
        raise PassError("ipu_replacements(serial_dense=True): this ipu_tensorflow_addons has no SerialDense.")
    if not (isinstance(factor, int) and not isinstance(factor, bool) and factor >= 1):
        raise PassError(
            "ipu_replacements(serial_dense=True) needs serialization_factor, a "
            f"positive integer (SerialDense requires it); got {factor!r}."
        )
    if dimension not in SERIALIZATION_DIMENSIONS:
        raise PassError(
            "ipu_replacements(serial_dense=True) needs serialization_dimension, "
            f"one of {', '.join(SERIALIZATION_DIMENSIONS)} (SerialDense requires "
            f"it); got {dimension!r}."
        )
    return Replacement(
        addons.SerialDense,
        params={"serialization_factor": factor, "serialization_dimension": dimension},
        copy_weights=True,
    )


class IpuReplace(Replace):
    """`Replace` with the addons layers, each matched layer and call checked
    against the limits of its replacement first (see the module docstring).

    Example:
        ```python
        [replace] = kip.ipu_replacements()
        isinstance(replace, IpuReplace)
        # -> True
        ```
    """

    def run(self, graph, report):
        # A preset: classes the model does not use are skipped (a plain
        # Replace refuses a target that matches nothing).
        present = {}
        for target, replacement in self.mapping.items():
            expand_to_reach(graph, target, report, "replace")
            nodes = nodes_matching(graph, target)
            for node in nodes:
                check_replaceable(node, replacement)
            if nodes:
                present[target] = replacement
        if not present:
            report.add(self.step, graph.name, "nothing replaced",
                       "no layer of the IPU replacement classes")
            return graph
        return Replace(present).run(graph, report)


def check_replaceable(node, replacement):
    """Raise a `PassError` naming `node` when `replacement` (an addons layer)
    cannot stand in for its layer."""
    layer, new = node.operation, replacement.new_class.__name__
    config = layer.get_config()
    config.update(replacement.params)

    def refuse(why):
        raise PassError(f"replace: `{node.name}` ({type(layer).__name__}) cannot become "
                        f"the IPU {new}: {why}")

    _check_static_inputs(node, refuse)
    if _has_mask(node):
        refuse("it receives a mask (the IPU layers raise on one or drop it); "
               "leave it out of the Replace targets, or drop the mask.")
    checks = {
        keras.layers.Dropout: _check_dropout,
        keras.layers.LayerNormalization: _check_layer_normalization,
        keras.layers.Embedding: _check_embedding,
        keras.layers.LSTM: _check_rnn,
        keras.layers.GRU: _check_rnn,
        keras.layers.Dense: _check_dense,
    }
    for keras_class, check in checks.items():
        if isinstance(layer, keras_class):
            check(node, config, refuse)
            return


def _check_static_inputs(node, refuse):
    for value in node.input_values:
        if any(dim is None for dim in value.spec.shape):
            refuse(f"its input has shape {tuple(value.spec.shape)}; IPU programs need "
                   "static shapes: convert with static_batch=True (and batch the "
                   "data with drop_remainder=True).")


def _has_mask(node):
    if isinstance(node.kwargs.get("mask"), Value):
        return True
    return any(_compat.keras_mask(v.spec) is not None for v in node.input_values)


def _set(config, *keys):
    """The keys of `config` whose values are set (not None / False / 0)."""
    return [key for key in keys if config.get(key)]


def _is_seed_pair(seed):
    return (isinstance(seed, (list, tuple)) and len(seed) == 2
            and all(isinstance(s, int) and not isinstance(s, bool) for s in seed))


def _check_dropout(node, config, refuse):
    seed = config.get("seed")
    if seed is not None and not _is_seed_pair(seed):
        refuse(f"seed={seed!r}; the IPU Dropout takes a pair of int32 "
               "(Replacement(..., params={'seed': [a, b]})) or no seed.")


def _check_layer_normalization(node, config, refuse):
    unsupported = _set(config, "beta_regularizer", "gamma_regularizer",
                       "beta_constraint", "gamma_constraint", "rms_scaling")
    if unsupported:
        refuse(f"it sets {', '.join(unsupported)}, which the IPU LayerNormalization does not support.")


def _check_embedding(node, config, refuse):
    unsupported = _set(config, "mask_zero", "embeddings_regularizer",
                       "activity_regularizer", "embeddings_constraint", "lora_rank",
                       "quantization_config")
    if unsupported:
        refuse(f"it sets {', '.join(unsupported)}, which the IPU Embedding does not support.")
    if len(node.input_values[0].spec.shape) != 2:
        refuse(f"its input has shape {tuple(node.input_values[0].spec.shape)}; the IPU "
               "Embedding takes (batch, length).")


def _check_rnn(node, config, refuse):
    unsupported = _set(config, "kernel_regularizer", "recurrent_regularizer",
                       "bias_regularizer", "activity_regularizer", "kernel_constraint",
                       "recurrent_constraint", "bias_constraint", "recurrent_dropout",
                       "go_backwards", "unroll", "stateful")
    if not config.get("use_bias", True):
        unsupported.append("use_bias=False")
    if unsupported:
        refuse(f"it sets {', '.join(unsupported)}, which Popnn RNN layers do not support.")
    for key, accepted in (("activation", _POPNN_ACTIVATIONS),
                          ("recurrent_activation", _POPNN_RECURRENT_ACTIVATIONS)):
        if _activation_name(config.get(key)) not in accepted:
            refuse(f"{key}={config.get(key)!r}; Popnn accepts {', '.join(accepted)}.")
    if config.get("dropout") and config.get("seed") is not None and not _is_seed_pair(config["seed"]):
        refuse(f"dropout with seed={config['seed']!r}; Popnn's dropout_seed is a pair of int32.")
    if len(node.args) > 1:
        refuse("it is called with more than one positional argument; Popnn's "
               "call(inputs, mask, training, initial_state) would bind the second to `mask`.")
    state = node.kwargs.get("initial_state")
    if isinstance(node.operation, keras.layers.GRU) and isinstance(state, (list, tuple)):
        refuse("its initial_state is a list; PopnnGRU takes one tensor.")


def _activation_name(activation):
    if isinstance(activation, str):
        return activation
    if isinstance(activation, dict):  # a serialized activation
        return activation.get("config", activation.get("class_name"))
    return getattr(activation, "__name__", repr(activation))


def _check_dense(node, config, refuse):
    unsupported = _set(config, "lora_rank", "quantization_config")
    if unsupported:
        refuse(f"it sets {', '.join(unsupported)}, which SerialDense does not support.")
    factor = config["serialization_factor"]
    shape = tuple(node.input_values[0].spec.shape)
    rows, columns = shape[-2:] if len(shape) > 1 else (None, shape[-1])
    dimension = {
        "input_columns": ("the input's rows", rows),
        "input_rows_kernel_columns": ("the input's columns", columns),
        "kernel_rows": ("units", config.get("units")),
    }[config["serialization_dimension"]]
    if dimension[1] is not None and dimension[1] % factor:
        refuse(f"serialization_factor={factor} does not divide {dimension[0]} ({dimension[1]}).")


def copy_rnn_weights(old, new):
    """Copy a Keras LSTM / GRU's weights into PopnnLSTM / PopnnGRU: `kernel`,
    `recurrent_kernel`, `bias` -> `biases`, same gate order and shapes.

    Example:
        ```python
        Replacement(addons.PopnnLSTM, copy_weights_fn=copy_rnn_weights)
        ```
    """
    sources = {v.name: v for v in old.weights}
    targets = {v.name: v for v in new.weights}
    for source_name, target_name in _POPNN_WEIGHTS.items():
        source, target = sources.get(source_name), targets.get(target_name)
        if source is None or target is None or tuple(source.shape) != tuple(target.shape):
            raise PassError(
                f"replace: cannot copy `{old.name}`.{source_name} "
                f"{None if source is None else tuple(source.shape)} into "
                f"`{new.name}`.{target_name} "
                f"{None if target is None else tuple(target.shape)}."
            )
    extra = set(targets) - set(_POPNN_WEIGHTS.values())
    if extra:
        raise PassError(f"replace: `{new.name}` has weights {sorted(extra)} with no Keras source.")
    for source_name, target_name in _POPNN_WEIGHTS.items():
        targets[target_name].assign(sources[source_name])


def ipu_replacements(serial_dense=False, *, serialization_factor=None,
                     serialization_dimension=None):
    """The IPU `Replace` pass (`IpuReplace`; empty off IPU): Dropout,
    LayerNormalization, Embedding, LSTM, GRU -> the `ipu_tensorflow_addons`
    layers, weights copied and each layer checked against the addons
    layer's limits. `serial_dense=True` also replaces Dense by SerialDense,
    which requires `serialization_factor` and `serialization_dimension`
    ("input_columns", "input_rows_kernel_columns" or "kernel_rows").

    Example:
        ```python
        passes = [kip.passes.Expand(), *kip.ipu_replacements()]
        kip.ipu_replacements(serial_dense=True, serialization_factor=4,
                             serialization_dimension="kernel_rows")
        ```
    """
    layers = get_backend().ipu_layers()
    if layers is None:
        return []
    return [ipu_replace(layers, serial_dense, serialization_factor, serialization_dimension)]
