"""A `call` that divides the batch size (`ops.shape(x)[0] // k`), traced at
multiples of what it divides by.

keras_hub's Swin `WindowAttention` gets rows of `batch * windows` and
reshapes them to `(B_ // num_win, num_win, ...)`. Traced at the trial batch
sizes (`batch_traces.TRIAL_BATCH_SIZES`, 1 and 3), `B_ // num_win` is 0,
and the layer stayed whole. Here the call is first traced once with its
inputs' leading size a `_TracedSize`, an int that notes what it is divided
by (`//`, `%`, `/`, `divmod`; sums and products of it note theirs too);
the two trial traces are then made at that many times the trial sizes
(`divided_trial_sizes`), where the divisions are exact. At the trial
sizes themselves `b // 4` is 0 in both traces, which would pass for a
fixed size.

What such traces show holds at multiples of the divisor only (`b // 4 * 4`
is the batch size there, and not at 5), so the graph made of them refuses
any other batch size when it runs: every dimension that divides the batch
is a `BatchSizedOperation` with a divisor, which raises on a batch size
that is no multiple of it, and each batch-led output passes a check of the
same (`batch_guards.divisibility_guards`). A third trace, at other multiples, confirms
the graph (`batch_traces.one_graph_for_any_batch`).

Only a size read from an input itself (`ops.shape(x)[0]`) notes its
divisions: Keras computes the shapes of what the call makes as plain ints.
A division of those stays as before (`ops.shape(flat)[0] // t` of a
`(b * t, d)` tensor is the batch size at every trial size).

Example:
    >>> divided_trial_sizes(layer, (x,), {}, placeholders, "", reads, None, tracer, error)
    (4, 12)
"""

import math

import keras

from keras_ipu_plugin.frontend.batch.traces import TRIAL_BATCH_SIZES
from keras_ipu_plugin.frontend.batch.traces import trace_at_two_batch_sizes
from keras_ipu_plugin.frontend.trace.failures import TraceError

# The size the probe trace gives its inputs' leading dimension: that of the
# second trial trace, so that code branching on a batch of one does not
# hide the division.
PROBE_SIZE = TRIAL_BATCH_SIZES[1]

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


class _ProbeTensor(keras.KerasTensor):
    """A KerasTensor whose leading size, as `call` reads it, is a
    `_TracedSize` (Keras keeps plain ints in the shapes it computes)."""

    def __init__(self, shape, dtype, divisors):
        super().__init__(shape, dtype=dtype)
        self.probe_size = _TracedSize(shape[0], divisors)

    @property
    def shape(self):
        shape = tuple(super().shape)
        return (self.probe_size,) + shape[1:]


def batch_divisor(layer, args, kwargs, placeholders, prefix, reads, training, tracer):
    """The least common multiple of what `call` divides its inputs' leading
    size by (1 where nothing), seen in one trace at `PROBE_SIZE`."""
    divisors = []

    def probe(shape, dtype):
        return _ProbeTensor(shape, dtype, divisors)

    try:
        trace_at_two_batch_sizes(layer, args, kwargs, placeholders, prefix, reads, training,
                                 None, tracer, batch_sizes=(PROBE_SIZE,), make_input=probe)
    except Exception:  # noqa: BLE001 - a probe: the trial traces say why a call fails
        pass
    return math.lcm(1, *divisors)


def divided_trial_sizes(layer, args, kwargs, placeholders, prefix, reads, training, tracer,
                        error):
    """The batch sizes to trace `call` at where it divides its inputs'
    leading size: `TRIAL_BATCH_SIZES` times what it divides by
    (`batch_divisor`); None where it divides by nothing. Past
    `LARGEST_DIVISOR`, raises `TraceError` (`error`: why the symbolic
    trace failed) saying so: at the trial sizes the division would be 0."""
    divisor = batch_divisor(layer, args, kwargs, placeholders, prefix, reads, training, tracer)
    if divisor == 1:
        return None
    if divisor > LARGEST_DIVISOR:
        raise TraceError(
            f"{error.reason}; `call` divides the batch size by {divisor}, and is traced at "
            f"multiples of a divisor up to {LARGEST_DIVISOR} only (at other sizes the "
            "division is not exact); write the reshape's batch dimension as -1, or convert "
            "with static_batch=True")
    return tuple(divisor * size for size in TRIAL_BATCH_SIZES)


__all__ = ["batch_divisor", "divided_trial_sizes"]
