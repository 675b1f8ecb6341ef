"""A `call` that divides the batch size (`ops.shape(x)[0] // k`), traced at
multiples of what it divides by.

keras_hub's Swin `WindowAttention` gets rows of `batch * windows` and
reshapes them to `(B_ // num_win, num_win, ...)`. Traced at the trial batch
sizes (`traces.TRIAL_BATCH_SIZES`, 1 and 3), `B_ // num_win` is 0,
and the layer stayed whole. Here the call is first traced once with its
inputs' leading size a `_TracedSize`, an int that notes what it is divided
by (`//`, `%`, `/`, `divmod`; sums and products of it note theirs too);
the two trial traces are then made at that many times the trial sizes
(`traces.divided_trial_sizes`), where the divisions are exact. At the trial
sizes themselves `b // 4` is 0 in both traces, which would pass for a
fixed size.

What such traces show holds at multiples of the divisor only (`b // 4 * 4`
is the batch size there, and not at 5), so the graph made of them refuses
any other batch size when it runs: every dimension that divides the batch
is a `BatchSizedOperation` with a divisor, which raises on a batch size
that is no multiple of it, and each batch-led output passes a check of the
same (`divisibility_guards`). A third trace, at other multiples, confirms
the graph (`traces.one_graph_for_any_batch`).

Only a size read from an input itself (`ops.shape(x)[0]`) notes its
divisions: Keras computes the shapes of what the call makes as plain ints.
A division of those stays as before (`ops.shape(flat)[0] // t` of a
`(b * t, d)` tensor is the batch size at every trial size).

Example:
    ```python
    divisors = []
    size = ProbeTensor((3, 16), "float32", divisors).shape[0]   # as `call` reads it
    size // 4, divisors
    # -> (0, [4])
    ```
"""

import math
from fractions import Fraction

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation

# Past this, a divisor is not followed (the layer stays whole, saying so):
# the trial traces are of batches this many times larger, and a constant
# the call makes with the batch in it (a causal mask broadcast to the
# batch, eagerly) grows with them. Swin's 224-pixel presets have 64 windows.
LARGEST_DIVISOR = 256


class _TracedSize(int):
    """An int standing for `multiple` times an input's leading size (plus a
    constant) in the probe trace, noting in `divisors` what the batch size
    must be a multiple of for each division of it by an int to be exact
    (`(b * 40) // 8`, as Keras works out a reshape's -1, needs nothing;
    `b // 4` needs 4); what is computed from it by adding or multiplying
    an int is one too."""

    def __new__(cls, value, divisors, multiple=1):
        size = super().__new__(cls, value)
        size.divisors, size.multiple = divisors, multiple
        return size

    def _noted(self, other):
        if isinstance(other, int) and not isinstance(other, bool) and abs(other) > 1:
            needed = abs(int(other)) // math.gcd(abs(int(other)), self.multiple)
            if needed > 1:
                self.divisors.append(needed)

    def _derived(self, value, multiple=None):
        if not isinstance(value, int) or isinstance(value, bool):
            return value
        return _TracedSize(value, self.divisors, self.multiple if multiple is None else multiple)

    def __floordiv__(self, other):
        self._noted(other)
        return int(self) // other

    def __mod__(self, other):
        self._noted(other)
        return int(self) % other

    def __truediv__(self, other):
        self._noted(other)
        return int(self) / other

    def __divmod__(self, other):
        self._noted(other)
        return divmod(int(self), other)

    def __add__(self, other):
        if isinstance(other, _TracedSize):  # `b + b`
            return self._derived(int(self) + int(other), self.multiple + other.multiple)
        return self._derived(int(self) + other)

    __radd__ = __add__

    def __sub__(self, other):
        if isinstance(other, _TracedSize):
            return int(self) - int(other)  # no longer a multiple of the batch alone
        return self._derived(int(self) - other)

    def __rsub__(self, other):
        return int(other) - int(self) if isinstance(other, int) else other - int(self)

    def __mul__(self, other):
        if isinstance(other, _TracedSize):
            return int(self) * int(other)  # `b * b`: no multiple of the batch
        if not isinstance(other, int) or isinstance(other, bool):
            return int(self) * other
        return self._derived(int(self) * other, self.multiple * other)

    __rmul__ = __mul__


class ProbeTensor(keras.KerasTensor):
    """A KerasTensor whose leading size, as `call` reads it, is a
    `_TracedSize` (Keras keeps plain ints in the shapes it computes)."""

    def __init__(self, shape, dtype, divisors):
        super().__init__(shape, dtype=dtype)
        self.probe_size = _TracedSize(shape[0], divisors)

    @property
    def shape(self):
        shape = tuple(super().shape)
        return (self.probe_size,) + shape[1:]


def divisibility_guards(outputs, anchor, scale, sizes, leading, prefix):
    """`(nodes, outputs)`: where the graph was traced at multiples of `scale`
    (> 1), each output whose leading size follows the batch passes a
    `BatchSizedOperation` that refuses a batch size of `anchor` that is no
    multiple of `scale` (an identity `broadcast_to` of it), so the graph
    never runs where the traces do not tell what it computes (`b // 4 * 4`
    is the batch size at multiples of 4 only). `leading`: each flat
    output's leading size in the two traces, `(a, b)` at the batch sizes
    `sizes` (multiples of `scale`).
    Raises `ValueError` where no output follows the batch.
    """
    nodes, guarded = [], {}
    small, large = sizes
    flat = []
    map_values(flat.append, outputs)
    for index, value in enumerate(flat):
        shape = tuple(value.spec.shape)
        sizes = leading[index] if index < len(leading) else None
        if (id(value) in guarded or value.mask is not None or not shape or shape[0] is not None or None in shape[1:]
                or sizes is None or not sizes[0] or sizes[0] * large != sizes[1] * small):
            continue
        ratio = Fraction(sizes[0], small) * scale  # rows per `scale` rows of the anchor
        if ratio.denominator != 1:
            continue
        name = f"{prefix}batch_multiple_of_{scale}_{len(nodes)}"
        check = BatchSizedOperation(
            _compat.broadcast_to_operation(shape), ["shape"],
            multiples={"shape": [int(ratio)] + [1] * (len(shape) - 1)},
            divisors={"shape": [scale] + [1] * (len(shape) - 1)},
            name=name.replace(".", "_"))
        node = Node(name, check, (anchor, value), {}, output_structure=None)
        node.outputs = [Value(node, 0, keras.KerasTensor(shape, dtype=value.spec.dtype))]
        nodes.append(node)
        guarded[id(value)] = node.outputs[0]
    if not nodes:
        raise ValueError(
            f"traced at multiples of {scale} (the call divides the batch size by it), "
            "and no output's leading size follows the batch size, to refuse others")
    return nodes, map_values(lambda v: guarded.get(id(v), v), outputs)


__all__ = ["LARGEST_DIVISOR", "ProbeTensor", "divisibility_guards"]
