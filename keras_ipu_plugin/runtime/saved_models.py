"""A `KipFunctional` saved and loaded: refused where Keras's legacy HDF5
format would lose it (`refuse_hdf5`), and its config checked, entry by entry,
before anything of it is made (`check_saved_entries`): the kip entries
(the mask's meaning, the pinned `training`, stage devices, layer paths,
annotations, the output structure of each mode) and every node of the graph,
which Keras calls while loading. Nothing read from a file becomes code: a
value of the wrong kind is a `kip.LoadError` naming the entry.

Example:
    ```python
    refuse_hdf5(converted, "m.h5")               # ValueError: use .keras
    check_saved_entries(config, "KipFunctional `net`")   # or kip.LoadError
    ```
"""

import os
import re

from keras_ipu_plugin import _compat
from keras_ipu_plugin.errors import LoadError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.layers import saved_values


#: `mask=` is a Keras mask put on the graph's inputs (a functional original).
MASK_ON_INPUTS = "inputs"
#: The original `call` takes no `mask`: only masks its inputs carry reach it.
MASK_ABSENT = "absent"
#: The original `call` takes `mask` as an argument; this graph was traced without one.
MASK_ARGUMENT = "argument"


def refuse_hdf5(model, filepath=None, zipped=None):
    """Raise a clear error where `model` would be saved as HDF5 (`m.h5`,
    `m.hdf5`): Keras's legacy format keeps neither the plugin's registered
    class names nor its graph's extras, so `keras.models.load_model` could
    not read the file back (`Unknown layer: 'KipFunctional'`). `filepath`
    None: the HDF5 writer is already running (`keras.saving.save_model`).

    Example:
        ```python
        refuse_hdf5(converted, "m.keras")      # fine
        refuse_hdf5(converted, "m.h5")         # ValueError: use .keras
        ```
    """
    if filepath is not None:
        path = str(os.fspath(filepath)) if hasattr(filepath, "__fspath__") else str(filepath)
        # As Keras chooses: HDF5 for a zipped save to a `.h5` / `.hdf5` path
        # (zipped defaults to True except on the Hugging Face Hub).
        if zipped is None:
            zipped = not path.startswith("hf://")
        if not (zipped and path.endswith((".h5", ".hdf5"))):
            return
        shown = f"`{path}`"
    elif _compat.saving_to_hdf5():
        shown = "an HDF5 file"
    else:
        return
    raise ValueError(
        f"Model `{model.name}` cannot be saved to {shown}: Keras's legacy HDF5 "
        "format does not record the plugin's registered classes (KipFunctional, "
        "PluginModel, the kip layers), so keras.models.load_model could not read "
        "it back. Save to a `.keras` file instead (model.save(\"m.keras\")); "
        "save_weights(\"m.weights.h5\") saves the weights alone."
    )


#: How Keras writes a symbolic tensor among a node's saved arguments.
_SYMBOLIC = "__keras_tensor__"
#: The other values Keras writes there (constants: a held array or tensor,
#: bytes, `...`, a slice); any other saved object is refused.
_CONSTANTS = ("__numpy__", "__tensor__", "__bytes__", "__ellipsis__", "__slice__")

#: The longest stage device name a saved graph may hold
#: (`/job:worker/replica:0/task:12/device:IPU:3` is 41).
MAX_DEVICE_NAME = 200


_DEVICE_PART = re.compile(r"/?(job:[A-Za-z0-9_-]{1,64}|replica:\d{1,6}|task:\d{1,6}|"
                          r"device:[A-Za-z_]{1,16}:(\d{1,6}|\*)|[A-Za-z_]{1,16}:(\d{1,6}|\*))")


def _is_device_name(name):
    """Whether `name` is a TensorFlow device name (`/cpu:0`,
    `/device:IPU:1`, `/job:worker/replica:0/task:0/device:GPU:0`) of
    bounded length and indices, as `tf.device` takes it."""
    if not (isinstance(name, str) and 0 < len(name) <= MAX_DEVICE_NAME):
        return False
    parts = [part for part in name.split("/") if part]
    return bool(parts) and all(_DEVICE_PART.fullmatch(part) for part in parts)


#: The keys a saved functional model's config has: Keras's and the kip ones.
_SAVED_KEYS = ("name", "trainable", "layers", "input_layers", "output_layers",
               "kip_original_mask", "kip_pinned_training", "kip_annotations",
               "kip_node_annotations", "kip_node_training", "kip_stage_devices", "kip_layer_paths", "kip_call_takes_training",
               "kip_output_modes")


def check_saved_entries(config, entry):
    """The entries of a saved config are data of the kinds `get_config`
    writes (`kip.LoadError` naming the key otherwise), checked before any
    layer is made: the kip entries, and every node of the graph, which
    Keras calls while loading (`_check_saved_nodes`)."""
    saved_values.saved_keys(config, entry, _SAVED_KEYS)
    _check_saved_nodes(config, entry)
    mask = config.get("kip_original_mask", MASK_ON_INPUTS)
    if mask not in (MASK_ON_INPUTS, MASK_ABSENT, MASK_ARGUMENT):
        saved_values.refuse(entry, "kip_original_mask",
                            f"one of {MASK_ON_INPUTS}, {MASK_ABSENT}, {MASK_ARGUMENT}", mask)
    saved_values.saved_bool(config.get("kip_call_takes_training", True), entry,
                            "kip_call_takes_training")
    if config.get("kip_output_modes") is not None:
        outputs = config.get("output_layers")
        count = len(outputs) if isinstance(outputs, list) and outputs and not isinstance(
            outputs[0], str) else 1
        check_output_modes(config["kip_output_modes"], count, entry, None)
    for key, kind in (("kip_pinned_training", "layer names"), ("kip_node_training", "node paths")):
        pinned = config.get(key) or {}
        if not (isinstance(pinned, dict) and all(isinstance(v, bool) for v in pinned.values())):
            saved_values.refuse(entry, key, f"a mapping of {kind} to true / false", pinned)
    devices = config.get("kip_stage_devices") or []
    if not (isinstance(devices, list) and all(_is_device_name(d) for d in devices)):
        saved_values.refuse(entry, "kip_stage_devices", "a list of TensorFlow device names "
                            f"(such as '/cpu:0', '/device:IPU:1'; at most {MAX_DEVICE_NAME} "
                            "characters)", devices)
    paths = config.get("kip_layer_paths") or {}
    if not (isinstance(paths, dict) and all(isinstance(v, str) for v in paths.values())):
        saved_values.refuse(entry, "kip_layer_paths", "a mapping of paths to layer names", paths)
    for key, kind in (("kip_annotations", "layer names"), ("kip_node_annotations", "node paths")):
        _check_saved_annotations(config.get(key) or {}, entry, key, kind)


def _check_saved_annotations(annotations, entry, key, kind):
    """A saved mapping of annotations (by Keras layer name, or by node
    path) holds mappings, a stage a non-negative int, outline options the
    arguments `ipu.outlined_function` takes."""
    if not (isinstance(annotations, dict)
            and all(isinstance(notes, dict) for notes in annotations.values())):
        saved_values.refuse(entry, key, f"a mapping of {kind} to mappings", annotations)
    for name, notes in annotations.items():
        where = f"{key}.{name}"
        if "stage" in notes and not (isinstance(notes["stage"], int)
                                     and not isinstance(notes["stage"], bool)
                                     and notes["stage"] >= 0):
            saved_values.refuse(entry, f"{where}.stage", "a non-negative int", notes["stage"])
        if "outline" in notes:
            from keras_ipu_plugin.runtime.backends.ipu import check_outline_kwargs

            options = notes["outline"]
            try:
                if not isinstance(options, dict):
                    raise PassError("a mapping of ipu.outlined_function's arguments")
                check_outline_kwargs(options)
            except PassError as error:
                saved_values.refuse(entry, f"{where}.outline", str(error), options)


#: The modes whose output structure `kip_output_modes` may give.
_OUTPUT_MODES = ("training", "inference", "default")


def check_output_modes(modes, count, entry, error):
    """`modes` is `{"outputs": {mode: nest of output indices below `count`},
    "none_means": one of those modes}`, with a training and an inference
    mode, each output read by one mode. `error`: the class raised (None: a
    file's value, `kip.LoadError` naming the key)."""
    def refuse(expected):
        if error is None:
            saved_values.refuse(entry, "kip_output_modes", expected, modes)
        raise error(f"{entry}: kip_output_modes must be {expected}; got {modes!r}.")

    if not (isinstance(modes, dict) and set(modes) == {"outputs", "none_means"}
            and isinstance(modes["outputs"], dict)
            and {"training", "inference"} <= set(modes["outputs"])
            and set(modes["outputs"]) <= set(_OUTPUT_MODES)
            and modes["none_means"] in modes["outputs"]):
        refuse("{'outputs': {training / inference (/ default): output indices}, "
               "'none_means': one of those modes}")
    seen = []
    for nest in modes["outputs"].values():
        stack = [nest]
        while stack:
            item = stack.pop()
            if isinstance(item, dict) and all(isinstance(k, str) for k in item):
                stack.extend(item.values())
            elif isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < count:
                seen.append(item)
            else:
                refuse(f"nests of output indices below {count}")
    if sorted(seen) != list(range(count)):
        refuse(f"each of the {count} outputs read by one mode")


def _check_saved_nodes(config, entry):
    """Each layer entry of a saved functional config is a mapping with a
    name, a class and a list of nodes, and each node (the arguments Keras
    calls the layer with while loading) holds a symbolic tensor of the
    graph: a traced call always does, so a node whose arguments are all
    constants (`tf.broadcast_to(1.0, [huge])`, a random draw anchored on
    a keyword constant) can only come from an edited file, and Keras would
    run it, eagerly, inside `load_model`. Refused naming the node, before
    any layer is made: whatever the load builds is built symbolically."""
    layers = config.get("layers")
    if not isinstance(layers, (list, tuple)):
        saved_values.refuse(entry, "layers", "a list of saved layers", layers)
    for key in ("input_layers", "output_layers"):
        if not isinstance(config.get(key), (list, tuple, dict)):
            saved_values.refuse(entry, key, "[layer, node, tensor] entries (a list or a "
                                "mapping of them)", config.get(key))
    inputs = config["input_layers"]
    inputs = list(inputs.values()) if isinstance(inputs, dict) else inputs
    if inputs and isinstance(inputs[0], str):  # one input: [layer, node, tensor] itself
        inputs = [inputs]
    shown = [repr(entry_) for entry_ in inputs]
    if len(set(shown)) != len(shown):
        # Keras writes each input once; one given twice loads a graph whose
        # first call fails (it expects an input more than its caller gives).
        saved_values.refuse(entry, "input_layers", "each input once", inputs)
    for index, layer in enumerate(layers):
        if not (isinstance(layer, dict) and isinstance(layer.get("name"), str)
                and isinstance(layer.get("class_name"), str)
                and isinstance(layer.get("inbound_nodes"), (list, tuple))):
            saved_values.refuse(entry, f"layers[{index}]", "a saved layer with a name, a class "
                                "and a list of inbound nodes", layer)
        where = f"{short_repr(layer['class_name'])[1:-1]} `{short_repr(layer['name'])[1:-1]}`"
        for node in layer["inbound_nodes"]:
            if not (isinstance(node, dict) and set(node) == {"args", "kwargs"}
                    and isinstance(node["args"], (list, tuple))
                    and isinstance(node["kwargs"], dict)):
                saved_values.refuse(entry, f"{where}: a node", "{'args': [...], 'kwargs': {...}}",
                                    node)
            if not _holds_symbolic_tensor(node, f"{entry}: {where}"):
                raise LoadError(
                    f"{entry}: {where} is called with constants only (no tensor of the graph "
                    "among its arguments). A graph kip saves calls every node on a graph "
                    "tensor; loading would run this one eagerly, so the file was edited. "
                    "Nothing was run.")


def _holds_symbolic_tensor(node, where):
    """Whether a saved node's arguments hold a symbolic tensor of the graph
    (`{"class_name": "__keras_tensor__", "config": {"keras_history": [layer,
    node, tensor]}}`), looked for without recursion (any depth). A saved
    object other than a tensor or a constant Keras writes (a layer, a
    model: Keras would make it from the arguments) is refused, and so is a
    constant of a dtype that is no Keras dtype (`"V1000000000"`: a
    gigabyte a value)."""
    found, stack = False, [node]
    while stack:
        value = stack.pop()
        if isinstance(value, (list, tuple)):
            stack.extend(value)
            continue
        if not isinstance(value, dict):
            continue
        inner = value.get("config")
        if "class_name" in value and "config" in value:
            kind = value["class_name"]
            if kind == _SYMBOLIC:
                history = inner.get("keras_history") if isinstance(inner, dict) else None
                if not (isinstance(history, (list, tuple)) and len(history) == 3
                        and isinstance(history[0], str) and all(
                            isinstance(i, int) and not isinstance(i, bool) and i >= 0
                            for i in history[1:])):
                    saved_values.refuse(where, "a tensor argument", "a graph tensor with its "
                                        "keras_history [layer, node, tensor]", value)
                found = True
                continue
            if kind not in _CONSTANTS or not isinstance(inner, dict):
                saved_values.refuse(where, "an argument", "a tensor of the graph or a "
                                    "constant", value)
            if kind in ("__numpy__", "__tensor__"):
                saved_values.saved_dtype(inner.get("dtype"), where, "a constant's dtype")
        stack.extend(value.values())
    return found
