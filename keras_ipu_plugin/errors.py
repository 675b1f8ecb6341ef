"""Errors raised by keras_ipu_plugin.

Every error subclasses `ValueError` or `TypeError`, so existing
`except ValueError` code keeps working, and every message names the layer,
key or value at fault. Values are shown by `short_repr`, so a message never
grows with the value it names.
"""

import reprlib

_SHORT = reprlib.Repr()
_SHORT.maxlevel = 2
_SHORT.maxdict = _SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxset = 3
_SHORT.maxstring = _SHORT.maxother = 40
_SHORT.maxlong = 40
_PATH_KEY_LENGTH = 40


class ConversionError(ValueError):
    """The converted model does not match the original, or cannot be built.

    Example:
        ```python
        try:
            kip.convert_to_functional(model, x)
        except kip.ConversionError as e:
            print(e)   # names the first mismatching output or variable
        ```
    """


class InputDataError(ValueError):
    """The data given to take the first batch from is not usable."""


class InputTypeError(TypeError):
    """The data given to take the first batch from has an unsupported type."""


class ConfigError(ValueError):
    """A pass configuration is invalid; `path` says where inside the config.

    Example:
        ```python
        try:
            kip.passes_from_config({"replace": {"Dense": {"params": {"unitz": 3}}}})
        except kip.ConfigError as e:
            e.path
        # -> 'replace.Dense.params.unitz'
        ```
    """

    def __init__(self, path, message):
        self.path = path
        super().__init__(f"{path}: {message}" if path else message)


class PassError(ValueError):
    """A pass cannot be applied (a target matches nothing, a bad parameter).

    `field` names the constructor argument at fault, when one is (a config
    read of the pass reports the error at that value's path).

    Example:
        ```python
        try:
            kip.passes.Recompute(auto=True, memory_budget=float("nan"))
        except kip.PassError as e:
            e.field
        # -> 'memory_budget'
        ```
    """

    def __init__(self, message, field=None):
        self.field = field
        super().__init__(message)


class LoadError(ValueError):
    """A saved model names something kip will not load: a TensorFlow
    function outside the table its tracer records, a value of the wrong
    type, an unknown key. Nothing the file names has run when it is raised;
    the message names the layer and the entry.

    Example:
        ```python
        try:
            keras.models.load_model("untrusted.keras")
        except kip.LoadError as e:
            print(e)   # TFFunction `evil`: refusing `tf.io.write_file` ...
        ```
    """


class IpuError(ValueError):
    """The IPU backend cannot do what was asked with Graphcore's SDK; the
    message names the model, layer or option and says what to do instead.

    Example:
        ```python
        try:
            kip.apply_passes(converted, [kip.passes.PipelineStages([["a"], ["b"]])])
        except kip.IpuError as e:
            print(e)   # e.g. the model lacks Graphcore's pipeline API
        ```
    """


def short_repr(value):
    """`repr(value)` cut to a few items and characters: an error message must
    not print a huge value (a config of a million keys, a string of 1 MB)."""
    return _SHORT.repr(value)


def config_error(path, error):
    """`error` (a pass's own check failing) as a `ConfigError` at `path`, or at
    the path of the argument it names (`PassError.field`): the path is the
    value's, `recompute.memory_budget`, not the pass's."""
    field = error.field if isinstance(error, PassError) else None
    return ConfigError(config_path(path, field) if field else path, str(error))


def config_path(path, key):
    """`path.key`, the place of `key` inside `path` in a config; a long key
    is cut (it is user data, and may be huge)."""
    text = str(key) if isinstance(key, (str, int, float, bool, type(None))) else "?"
    if len(text) > _PATH_KEY_LENGTH:
        text = text[: _PATH_KEY_LENGTH - 3] + "..."
    return f"{path}.{text}" if path else text
