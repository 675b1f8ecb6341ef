"""A sequence-to-sequence model with teacher forcing, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/seq2seq.py

An encoder–decoder in the style of the Keras seq2seq tutorial, written as a
subclassed model: an `Encoder` layer (Embedding + LSTM, returning its final
states) and a `Decoder` layer (Embedding + LSTM started from those states +
a Dense over the vocabulary). The model takes two inputs (a dict): the
source tokens and the target tokens shifted right (teacher forcing); the
task is to reverse the source. `Expand` inlines the encoder and decoder;
`PipelineStages` puts the encoder's layers in stage 0 and the decoder's in
stage 1 (`model.converted.kip_stages`); `kip_stage_devices` can place
them on devices (the IPU backend would hand them to Graphcore's pipeline
API; it has never run on an IPU, see the README).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

VOCAB, LENGTH, UNITS = 12, 6, 32
START = 1  # token 1 starts every decoder input; 2..VOCAB-1 are data


class Encoder(keras.layers.Layer):
    def __init__(self, vocab=VOCAB, units=UNITS, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.units = vocab, units
        self.embedding = keras.layers.Embedding(vocab, units // 2, name="embedding")
        self.lstm = keras.layers.LSTM(units, return_state=True, name="lstm")

    def call(self, tokens):
        _, state_h, state_c = self.lstm(self.embedding(tokens))
        return state_h, state_c

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "units": self.units}


class Decoder(keras.layers.Layer):
    def __init__(self, vocab=VOCAB, units=UNITS, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.units = vocab, units
        self.embedding = keras.layers.Embedding(vocab, units // 2, name="embedding")
        self.lstm = keras.layers.LSTM(units, return_sequences=True, name="lstm")
        self.logits = keras.layers.Dense(vocab, name="logits")

    def call(self, tokens, states):
        x = self.lstm(self.embedding(tokens), initial_state=list(states))
        return self.logits(x)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "units": self.units}


class Seq2Seq(keras.Model):
    def __init__(self, vocab=VOCAB, units=UNITS, **kwargs):
        super().__init__(**kwargs)
        self.encoder = Encoder(vocab, units, name="encoder")
        self.decoder = Decoder(vocab, units, name="decoder")

    def call(self, inputs):
        states = self.encoder(inputs["source"])
        return self.decoder(inputs["target_in"], states)


def build_model():
    return Seq2Seq()


def make_data(samples=512, seed=0):
    """({'source', 'target_in'}, target): the target is the source reversed;
    `target_in` is the target shifted right behind a start token."""
    rng = np.random.default_rng(seed)
    source = rng.integers(2, VOCAB, size=(samples, LENGTH))
    target = source[:, ::-1]
    target_in = np.concatenate([np.full((samples, 1), START), target[:, :-1]], axis=1)
    x = {"source": source.astype("int32"), "target_in": target_in.astype("int32")}
    return x, target.astype("int32")


def passes():
    # Expand names the inlined layers `encoder.embedding`, `decoder.lstm`, ...;
    # without Expand, `[["encoder"], ["decoder"]]` stages the two blocks whole.
    return [
        kip.passes.Expand(),
        kip.passes.PipelineStages([
            ["encoder.embedding", "encoder.lstm"],                    # stage 0
            ["decoder.embedding", "decoder.lstm", "decoder.logits"],  # stage 1
        ]),
    ]


def compile_model(model):
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def main():
    keras.utils.set_random_seed(0)
    x, y = make_data()
    model = kip.PluginModel(build_model(), passes=passes())
    compile_model(model)
    history = model.fit(x, y, batch_size=64, epochs=3, verbose=2)
    print(model.kip_report)
    print(f"pipeline stages: {model.converted.kip_stages}")
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
