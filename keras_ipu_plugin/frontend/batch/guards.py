"""Checks that a graph traced at multiples of a batch divisor runs only there.

A call that divides the batch size (`ops.shape(x)[0] // k`) is traced at
multiples of k (`batch_divisions.py`); what the traces show holds there
only (`b // 4 * 4` is the batch size at multiples of 4, and 4 at 5). Each
of its outputs whose leading size follows the batch passes a
`BatchSizedOperation` (an identity `broadcast_to`) whose divisor refuses a
batch size that is no multiple of k, with the reason.

Example:
    >>> guards, outputs = divisibility_guards(outputs, anchor, 4, (4, 12), [(4, 12)], "b.")
"""

from fractions import Fraction

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import map_values
from keras_ipu_plugin.layers.keras_ops.batch_sized import BatchSizedOperation


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


__all__ = ["divisibility_guards"]
