"""A small zoo of subclassed Keras models shared by the test files.

Each model is tiny (tests must be fast) but exercises one thing conversion
must get right: custom layers, BatchNormalization, masking, dict inputs and
outputs, deep nesting, Python control flow on tensor values, a sub-layer with
a hard-coded `training=False`, string inputs.

Each `make_*` function returns `(model, x)`: a fresh model and a first batch
for it (numpy, so a test can wrap it in any data form it needs).
"""

import keras
import numpy as np
import tensorflow as tf


# -- MLP --------------------------------------------------------------------
class MLP(keras.Model):
    """Dense -> Dropout -> Dense -> Dense."""

    def __init__(self, hidden=16, outputs=3, **kwargs):
        super().__init__(**kwargs)
        self.dense_1 = keras.layers.Dense(hidden, activation="relu")
        self.dropout = keras.layers.Dropout(0.2)
        self.dense_2 = keras.layers.Dense(hidden, activation="tanh")
        self.head = keras.layers.Dense(outputs)

    def call(self, inputs, training=None):
        x = self.dense_1(inputs)
        x = self.dropout(x, training=training)
        x = self.dense_2(x)
        return self.head(x)


class BlockBetweenDense(keras.Model):
    """`block` between two Dense layers, on inputs of shape (batch, any):
    the smallest model around a layer under test."""

    def __init__(self, block, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Dense(6, name="embed")
        self.block = block
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x):
        return self.head(self.block(self.embed(x)))


def make_mlp(batch=8, features=6):
    x = np.random.RandomState(0).normal(size=(batch, features)).astype("float32")
    return MLP(), x


# -- CNN with custom residual blocks ---------------------------------------
class ResidualBlock(keras.layers.Layer):
    """Conv -> BN -> relu -> Conv -> BN, plus the input (a custom layer)."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv_1 = keras.layers.Conv2D(filters, 3, padding="same")
        self.bn_1 = keras.layers.BatchNormalization()
        self.conv_2 = keras.layers.Conv2D(filters, 3, padding="same")
        self.bn_2 = keras.layers.BatchNormalization()

    def call(self, inputs, training=None):
        x = self.conv_1(inputs)
        x = self.bn_1(x, training=training)
        x = keras.ops.relu(x)
        x = self.conv_2(x)
        x = self.bn_2(x, training=training)
        return keras.ops.relu(x + inputs)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


class ResNetTiny(keras.Model):
    def __init__(self, filters=4, classes=3, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(filters, 3, padding="same")
        self.stem_bn = keras.layers.BatchNormalization()
        self.block_1 = ResidualBlock(filters)
        self.block_2 = ResidualBlock(filters)
        self.pool = keras.layers.GlobalAveragePooling2D()
        self.head = keras.layers.Dense(classes)

    def call(self, inputs, training=None):
        x = keras.ops.relu(self.stem_bn(self.stem(inputs), training=training))
        x = self.block_1(x, training=training)
        x = self.block_2(x, training=training)
        return self.head(self.pool(x))


def make_cnn(batch=4):
    x = np.random.RandomState(1).normal(size=(batch, 8, 8, 3)).astype("float32")
    return ResNetTiny(), x


# -- small transformer encoder with masking --------------------------------
class PositionEmbedding(keras.layers.Layer):
    """Token embedding (mask_zero) plus a learned position embedding."""

    def __init__(self, vocab, length, dim, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(vocab, dim, mask_zero=True)
        self.positions = keras.layers.Embedding(length, dim)
        self.length = length

    def call(self, inputs):
        positions = keras.ops.arange(0, keras.ops.shape(inputs)[-1])
        return self.tokens(inputs) + self.positions(positions)

    def compute_mask(self, inputs, mask=None):
        return self.tokens.compute_mask(inputs)


class EncoderBlock(keras.layers.Layer):
    """Self-attention (padding mask) + feed-forward, post-norm."""

    def __init__(self, dim, heads, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True  # the mask is passed on unchanged
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.norm_1 = keras.layers.LayerNormalization()
        self.dropout = keras.layers.Dropout(0.1)
        self.ff_1 = keras.layers.Dense(dim * 2, activation="relu")
        self.ff_2 = keras.layers.Dense(dim)
        self.norm_2 = keras.layers.LayerNormalization()

    def call(self, inputs, mask=None, training=None):
        attention_mask = None
        if mask is not None:
            attention_mask = keras.ops.logical_and(
                keras.ops.expand_dims(mask, 1), keras.ops.expand_dims(mask, 2)
            )
        attended = self.attention(
            inputs, inputs, attention_mask=attention_mask, training=training
        )
        x = self.norm_1(inputs + self.dropout(attended, training=training))
        return self.norm_2(x + self.ff_2(self.ff_1(x)))


class TinyTransformer(keras.Model):
    def __init__(self, vocab=20, length=6, dim=8, heads=2, classes=2, **kwargs):
        super().__init__(**kwargs)
        self.embedding = PositionEmbedding(vocab, length, dim)
        self.block = EncoderBlock(dim, heads)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(classes)

    def call(self, inputs, training=None):
        x = self.embedding(inputs)
        mask = self.embedding.compute_mask(inputs)
        x = self.block(x, mask=mask, training=training)
        return self.head(self.pool(x, mask=mask))


def make_transformer(batch=4, length=6, vocab=20):
    tokens = np.random.RandomState(2).randint(1, vocab, size=(batch, length))
    tokens[:, -2:] = 0  # padding, so the mask matters
    tokens[0, 3:] = 0
    return TinyTransformer(vocab=vocab, length=length), tokens.astype("int32")


class MaskedRNN(keras.Model):
    """Embedding(mask_zero=True) feeding a GRU: padded steps are skipped."""

    def __init__(self, vocab=20, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(vocab, 4, mask_zero=True)
        self.gru = keras.layers.GRU(5)
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        return self.head(self.gru(self.embedding(inputs), training=training))


def make_rnn(batch=4, length=6, vocab=20):
    _, tokens = make_transformer(batch, length, vocab)
    return MaskedRNN(vocab=vocab), tokens


# -- dict inputs, several outputs ------------------------------------------
class DictModel(keras.Model):
    """Dict in (float features + int token ids), dict out."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(10, 4)
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.dense = keras.layers.Dense(8, activation="relu")
        self.concat = keras.layers.Concatenate()
        self.score = keras.layers.Dense(1)
        self.label = keras.layers.Dense(3)

    def call(self, inputs):
        tokens = self.pool(self.embedding(inputs["tokens"]))
        features = self.dense(inputs["features"])
        joint = self.concat([tokens, features])
        return {"score": self.score(joint), "label": self.label(joint)}


class TupleOutputModel(keras.Model):
    """List in (two float inputs), tuple (or list) out."""

    def __init__(self, as_list=False, **kwargs):
        super().__init__(**kwargs)
        self.as_list = as_list
        self.left = keras.layers.Dense(4)
        self.right = keras.layers.Dense(4)
        self.add = keras.layers.Add()
        self.out_1 = keras.layers.Dense(2)
        self.out_2 = keras.layers.Dense(1)

    def call(self, inputs):
        a, b = inputs
        joint = self.add([self.left(a), self.right(b)])
        outputs = (self.out_1(joint), self.out_2(joint))
        return list(outputs) if self.as_list else outputs


def make_dict_model(batch=6):
    rng = np.random.RandomState(3)
    x = {
        "features": rng.normal(size=(batch, 5)).astype("float32"),
        "tokens": rng.randint(0, 10, size=(batch, 7)).astype("int64"),
    }
    return DictModel(), x


def make_tuple_model(batch=6, as_list=False):
    rng = np.random.RandomState(4)
    x = [
        rng.normal(size=(batch, 3)).astype("float32"),
        rng.normal(size=(batch, 5)).astype("float32"),
    ]
    return TupleOutputModel(as_list=as_list), x


# -- three levels of nested custom layers ----------------------------------
class Leaf(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units)
        self.norm = keras.layers.LayerNormalization()

    def call(self, inputs):
        return keras.ops.gelu(self.norm(self.dense(inputs)))


class Middle(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.leaf_1 = Leaf(units)
        self.leaf_2 = Leaf(units)

    def call(self, inputs):
        return self.leaf_2(self.leaf_1(inputs)) + inputs


class Outer(keras.layers.Layer):
    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.middle_1 = Middle(units)
        self.middle_2 = Middle(units)
        self.scale = keras.layers.Dense(units, use_bias=False)

    def call(self, inputs):
        return self.scale(self.middle_2(self.middle_1(inputs)))


class NestedModel(keras.Model):
    def __init__(self, units=6, **kwargs):
        super().__init__(**kwargs)
        self.outer = Outer(units)
        self.head = keras.layers.Dense(2)

    def call(self, inputs):
        return self.head(self.outer(inputs))


def make_nested(batch=5, units=6):
    x = np.random.RandomState(5).normal(size=(batch, units)).astype("float32")
    return NestedModel(units=units), x


# -- Python control flow on a tensor value ---------------------------------
class DynamicBranchModel(keras.Model):
    """Keras 3 port of the model in shared/seeds/dynamic-variables-discussion:
    `call` branches in Python on the value of its input, so it cannot be
    traced on symbolic inputs."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense_layer = keras.layers.Dense(1)
        self.layer1 = keras.layers.Dense(1)
        self.layer2 = keras.layers.Dense(1)

    def call(self, inputs):
        x = self.dense_layer(inputs)
        if inputs[0] > 0.1:
            return x
        else:
            return self.layer1(x)


def make_dynamic(batch=4, value=0.2):
    return DynamicBranchModel(), np.full((batch, 1), value, dtype="float32")


# -- frozen BatchNormalization ---------------------------------------------
class FrozenBNModel(keras.Model):
    """Fine-tuning pattern: a BatchNormalization called with a hard-coded
    `training=False`, so its moving statistics must never change."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.frozen_bn = keras.layers.BatchNormalization()
        self.dropout = keras.layers.Dropout(0.1)
        self.head = keras.layers.Dense(1)

    def call(self, inputs, training=None):
        x = self.dense(inputs)
        x = self.frozen_bn(x, training=False)
        x = self.dropout(x, training=training)
        return self.head(x)


def make_frozen_bn(batch=8):
    x = np.random.RandomState(6).normal(3.0, 2.0, size=(batch, 3)).astype("float32")
    return FrozenBNModel(), x


# -- string input ------------------------------------------------------------
class StringModel(keras.Model):
    """Raw strings in; StringLookup -> Embedding -> Dense."""

    VOCAB = ["red", "green", "blue", "cyan"]

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.lookup = keras.layers.StringLookup(vocabulary=self.VOCAB)
        self.embedding = keras.layers.Embedding(len(self.VOCAB) + 1, 4)
        self.flatten = keras.layers.Flatten()
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        return self.head(self.flatten(self.embedding(self.lookup(inputs))))


def make_string(batch=4):
    x = np.array(
        [["red", "blue"], ["green", "magenta"], ["cyan", "red"], ["blue", "blue"]]
    )[:batch]
    return StringModel(), x


#: Models whose conversion must trace into sub-layers (not opaque).
TRACEABLE = {
    "mlp": make_mlp,
    "cnn": make_cnn,
    "transformer": make_transformer,
    "rnn": make_rnn,
    "dict": make_dict_model,
    "tuple": make_tuple_model,
    "list": lambda: make_tuple_model(as_list=True),
    "nested": make_nested,
    "frozen_bn": make_frozen_bn,
    "string": make_string,
}


def as_tensor(x):
    """`x` with every numpy leaf a tf.Tensor."""
    return tf.nest.map_structure(tf.convert_to_tensor, x)


# -- losses added inside blocks ------------------------------------------------
class RegularizedBlock(keras.layers.Layer):
    """An activity regularizer (added by `__call__`) and an `add_loss` in `call`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, activation="tanh", name="dense",
                                        activity_regularizer=keras.regularizers.L2(0.1))

    def call(self, x):
        h = self.dense(x)
        self.add_loss(0.01 * keras.ops.mean(h ** 2))
        return x + h


class RegularizedTower(keras.Model):
    """`depth` RegularizedBlocks (`blocks.i`, Keras names `block_i`) and a head."""

    def __init__(self, depth=3, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [RegularizedBlock(name=f"block_{i}") for i in range(depth)]
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# -- a layer writing a variable in call: keras.io's PixelCNN ------------------
class PixelConvLayer(keras.layers.Layer):
    """As keras.io's PixelCNN example writes it."""

    def __init__(self, mask_type, **kwargs):
        super().__init__(name=kwargs.pop("name", None))
        self.mask_type = mask_type
        self.conv = keras.layers.Conv2D(**kwargs)

    def build(self, input_shape):
        self.conv.build(input_shape)
        kernel_shape = keras.ops.shape(self.conv.kernel)
        self.mask = np.zeros(shape=kernel_shape)
        self.mask[: kernel_shape[0] // 2, ...] = 1.0
        self.mask[kernel_shape[0] // 2, : kernel_shape[1] // 2, ...] = 1.0
        if self.mask_type == "B":
            self.mask[kernel_shape[0] // 2, kernel_shape[1] // 2, ...] = 1.0

    def call(self, inputs):
        self.conv.kernel.assign(self.conv.kernel * self.mask)
        return self.conv(inputs)


class PixelCNN(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.first = PixelConvLayer("A", filters=4, kernel_size=5, padding="same",
                                    activation="relu", name="first")
        self.second = PixelConvLayer("B", filters=4, kernel_size=3, padding="same",
                                     activation="relu", name="second")
        self.head = keras.layers.Conv2D(1, 1, name="head")

    def call(self, x):
        return self.head(self.second(self.first(x)))


class DecaysAfterUse(keras.layers.Layer):
    """Halves its Dense's kernel after using it: this call's output and
    gradients do not show the write, the next call's would."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        y = self.dense(x)
        self.dense.kernel.assign(self.dense.kernel * 0.5)
        return y


class GrowingModel(keras.Model):
    """Grows a head when a callback flips `grow` between epochs."""

    def __init__(self):
        super().__init__()
        self.grow = False
        self.base = keras.layers.Dense(4, activation="tanh")
        self.extra = keras.layers.Dense(
            4, kernel_initializer=keras.initializers.GlorotUniform(seed=3), name="extra")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        x = self.base(x)
        if self.grow:
            x = x + self.extra(x)
        return self.out(x)


class GrowAt(keras.callbacks.Callback):
    def __init__(self, model, epoch):
        super().__init__()
        self.target, self.epoch = model, epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            self.target.grow = True


class NormBlock(keras.layers.Layer):
    """`x + LayerNorm(Dense(x))`: a residual block of two Keras layers."""

    def __init__(self, width=32, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(width, activation="gelu")
        self.norm = keras.layers.LayerNormalization()

    def call(self, x):
        return x + self.norm(self.dense(x))


class NormTower(keras.Model):
    """A Dense stem, `depth` `NormBlock`s named block_0, block_1, ... and a
    Dense(1) head."""

    def __init__(self, depth=12, width=32):
        super().__init__()
        self.stem = keras.layers.Dense(width)
        self.blocks = [NormBlock(width, name=f"block_{i}") for i in range(depth)]
        self.head = keras.layers.Dense(1)

    def call(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def regression_data(n=64, features=16):
    """`n` rows of `features` normal inputs and one normal target (seed 0)."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, features)).astype("float32"), rng.normal(size=(n, 1)).astype("float32")


class MaskedAttentionBlock(keras.layers.Layer):
    """Self-attention under a padding mask passed as a keyword, then LayerNorm."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        self.norm = keras.layers.LayerNormalization()

    def call(self, x, mask=None):
        return self.norm(x + self.attention(x, x, attention_mask=mask))


class MaskedTower(keras.Model):
    """Token ids (0 pads) through an Embedding and `depth`
    `MaskedAttentionBlock`s named masked_0, ...; a Dense(1) head on the first token."""

    def __init__(self, depth=3):
        super().__init__()
        self.embed = keras.layers.Embedding(20, 8)
        self.blocks = [MaskedAttentionBlock(name=f"masked_{i}") for i in range(depth)]
        self.head = keras.layers.Dense(1)

    def call(self, ids):
        mask = keras.ops.expand_dims(keras.ops.not_equal(ids, 0), 1)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask=mask)
        return self.head(x[:, 0])
