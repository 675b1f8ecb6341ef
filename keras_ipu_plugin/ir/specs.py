"""What a graph's inputs are: `InputSpec`s, and the check that data fits them.

Example:
    >>> spec = InputSpec(name="tokens", shape=(16,), dtype="int32")
    >>> spec.keras_input()
    <KerasTensor shape=(None, 16), dtype=int32, ...>
"""

from dataclasses import dataclass

import keras
import numpy as np

from keras_ipu_plugin.errors import InputDataError


@dataclass(frozen=True)
class InputSpec:
    """Shape (without batch), dtype and name of one model input."""

    name: str
    shape: tuple
    dtype: str
    batch_size: object = None  # None, or the static per-replica batch

    def keras_input(self):
        return keras.Input(
            shape=self.shape,
            batch_size=self.batch_size,
            dtype=self.dtype,
            name=self.name,
        )


def dtype_kind(dtype):
    """`"float"`, `"int"`, `"bool"`, `"string"` or `"complex"`: what a cast
    between two dtypes of different kinds would change (it truncates floats
    to ints, turns numbers into True / False, fails on strings).

    Example:
        >>> dtype_kind("uint8"), dtype_kind(tf.float16), dtype_kind(np.dtype("<U3"))
        ('int', 'float', 'string')
    """
    if isinstance(dtype, np.dtype) and dtype.kind in "USO":
        return "string"
    name = keras.backend.standardize_dtype(dtype)
    for kind in ("bool", "string", "complex", "int", "float"):
        if kind in name:
            return kind
    return name


def check_dtype_kinds(model_name, expected, given):
    """Raise `InputDataError` when a leaf of `given` has another dtype kind
    than the model input it feeds (`expected`, KerasTensors in the same
    order). Keras would cast it silently: a float batch fed to an input
    converted as int32 would be truncated. Same kind, other width (float64
    data for a float32 input) is Keras's usual cast, and is kept.

    Example:
        >>> check_dtype_kinds("net", converted.inputs, [np.zeros((2, 3), "int32")])
    """
    for tensor, leaf in zip(expected, given):
        if leaf is None:
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            dtype = np.asarray(leaf).dtype
        if dtype_kind(dtype) != dtype_kind(tensor.dtype):
            got = dtype if isinstance(dtype, np.dtype) and dtype.kind in "USO" else (
                keras.backend.standardize_dtype(dtype))
            raise InputDataError(
                f"Input `{tensor.name}` of `{model_name}` was converted as "
                f"{tensor.dtype} (from the first batch), but this batch gives it "
                f"{got}. Keras would cast {got} to {tensor.dtype} without a "
                "word and change the values; cast the data yourself if that is "
                "meant, or convert the model on data of this dtype."
            )
