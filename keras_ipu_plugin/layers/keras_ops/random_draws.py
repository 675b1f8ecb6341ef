"""`RandomDraw`: a `keras.random` draw a layer's `call` makes, as a graph node.

`keras.random.normal(shape=(ops.shape(x)[0], dim), seed=self.seed_generator)`
(a VAE's sampling layer) is not a symbolic operation: run while tracing it
would draw once, with the batch size unknown (None), and advance the
layer's seed generator. The tracer records such a draw as this layer
instead: it makes the same `keras.random` call when the graph runs, from
the same `SeedGenerator` object (tracked, so its state is a variable of
the graph's model as it was of the original), with each None of its shape
set to the batch size of a graph tensor (`anchor`). The draws are the
original's, number for number, given the same generator state.

Example:
    ```python
    draw = RandomDraw("normal", (None, 2), {}, seed=layer.seed_generator)
    draw(x).shape   # x: (batch, ...)
    # -> (batch, 2)
    ```
"""

import keras

from keras_ipu_plugin import _compat
from keras_ipu_plugin.layers import saved_values

# The `keras.random` functions a draw can be, and the keyword arguments
# (besides `shape`, `dtype` and `seed`) each takes.
DISTRIBUTIONS = {
    "normal": ("mean", "stddev"),
    "uniform": ("minval", "maxval"),
    "truncated_normal": ("mean", "stddev"),
}


@keras.saving.register_keras_serializable(package="keras_ipu_plugin")
class RandomDraw(keras.layers.Layer):
    """Draws `keras.random.<distribution>(shape, **arguments, dtype=...,
    seed=seed)` with each None of `shape` set to `anchor`'s batch size.

    `seed`: the `SeedGenerator` the original call drew from (the same
    object), an int, or None (Keras's global generator).

    Example:
        ```python
        RandomDraw("uniform", (None, 1, 1), {"minval": 0, "maxval": 1},
                   seed=generator)(x).shape
        # -> (batch, 1, 1)
        ```
    """

    def __init__(self, distribution, shape, arguments, seed=None, draw_dtype=None, **kwargs):
        # The draw's dtype is what the call asked for, not a policy's.
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"Unknown distribution {distribution!r}: one of {list(DISTRIBUTIONS)}")
        for key in arguments:
            if key not in DISTRIBUTIONS[distribution]:
                raise ValueError(f"keras.random.{distribution} takes no argument {key!r} "
                                 f"(it takes {', '.join(DISTRIBUTIONS[distribution])}).")
        if isinstance(seed, dict):  # loaded: the saved state fills it
            seed = saved_values.saved_keras_object(
                seed, f"RandomDraw `{kwargs.get('name')}`", "seed", keras.random.SeedGenerator,
                modules=_compat.SEED_GENERATOR_MODULES)
        self.distribution = distribution
        self.draw_shape = tuple(shape)
        self.arguments = dict(arguments)
        self.draw_dtype = draw_dtype
        # Tracked (not a copy): the graph's model owns the generator's state.
        self.seed_generator = seed
        self.built = True

    def __call__(self, *args, **kwargs):
        saved_values.refuse_constant_call(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    def _shape(self, batch_size):
        return tuple(batch_size if dim is None else dim for dim in self.draw_shape)

    def call(self, anchor):
        draw = getattr(keras.random, self.distribution)
        return draw(self._shape(keras.ops.shape(anchor)[0]), **self.arguments,
                    dtype=self.draw_dtype, seed=self.seed_generator)

    def compute_output_spec(self, anchor):
        return keras.KerasTensor(self._shape(anchor.shape[0]),
                                 dtype=self.draw_dtype or keras.config.floatx())

    def get_config(self):
        config = super().get_config()
        seed = self.seed_generator
        if isinstance(seed, keras.random.SeedGenerator):
            seed = keras.saving.serialize_keras_object(seed)
        config.update(
            distribution=self.distribution, shape=list(self.draw_shape),
            arguments=self.arguments, seed=seed, draw_dtype=self.draw_dtype,
        )
        return config

    @classmethod
    def from_config(cls, config):
        entry = f"RandomDraw `{config.get('name')}`"
        saved_values.saved_layer_config(config, entry, (
            "distribution", "shape", "arguments", "seed", "draw_dtype"))
        distribution = config.get("distribution")
        if distribution not in DISTRIBUTIONS:
            saved_values.refuse(entry, "distribution", f"one of {', '.join(DISTRIBUTIONS)}",
                                distribution)
        saved_values.saved_shape(config.get("shape"), entry, "shape")
        arguments = config.get("arguments")
        if not isinstance(arguments, dict):
            saved_values.refuse(entry, "arguments", "a mapping", arguments)
        for key, value in arguments.items():
            if key not in DISTRIBUTIONS[distribution]:
                saved_values.refuse(entry, "arguments",
                                    f"keys of {', '.join(DISTRIBUTIONS[distribution])}", key)
            saved_values.saved_number(value, entry, f"arguments.{key}")
        seed = config.get("seed")
        if not (seed is None or isinstance(seed, dict)
                or (isinstance(seed, int) and not isinstance(seed, bool))):
            saved_values.refuse(entry, "seed", "null, an int or a saved SeedGenerator", seed)
        saved_values.saved_dtype(config.get("draw_dtype"), entry, "draw_dtype", allow_none=True)
        return cls(**config)


__all__ = ["DISTRIBUTIONS", "RandomDraw"]
