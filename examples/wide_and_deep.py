"""A wide & deep model with two optimizers, through keras_ipu_plugin.

Runs on CPU in a few seconds on synthetic data:

    python examples/wide_and_deep.py

The premade-model pattern (Keras "premade models" RFC) as a subclassed
model: dict inputs with numeric and categorical (string) features,
preprocessing layers inside the model (`StringLookup`, an adapted
`Normalization`, an adapted `Discretization`), a linear ("wide") part on
one-hot features and a deep tower on embeddings, and a custom
`train_step` that updates the wide part with SGD and the deep part with
Adam. The optimizers are attributes of the model; the loss is the one given
to `compile` on the `kip.PluginModel` wrapper. `Expand` inlines the deep
tower (a custom layer).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402

CITIES = ["london", "paris", "berlin", "madrid", "rome"]
JOBS = ["engineer", "teacher", "doctor", "artist"]
AGE_BINS = 4


class DeepTower(keras.layers.Layer):
    def __init__(self, units=(16, 8), **kwargs):
        super().__init__(**kwargs)
        self.units = tuple(units)
        self.hidden = [
            keras.layers.Dense(u, activation="relu", name=f"hidden_{i}")
            for i, u in enumerate(self.units)
        ]
        self.out = keras.layers.Dense(1, name="logit")

    def call(self, inputs):
        x = inputs
        for layer in self.hidden:
            x = layer(x)
        return self.out(x)

    def get_config(self):
        return {**super().get_config(), "units": list(self.units)}


class WideAndDeep(keras.Model):
    def __init__(self, cities=CITIES, jobs=JOBS, **kwargs):
        super().__init__(**kwargs)
        # preprocessing
        self.city_lookup = keras.layers.StringLookup(vocabulary=cities, name="city_lookup")
        self.job_lookup = keras.layers.StringLookup(vocabulary=jobs, name="job_lookup")
        self.numeric_norm = keras.layers.Normalization(name="numeric_norm")
        self.age_buckets = keras.layers.Discretization(num_bins=AGE_BINS, name="age_buckets")
        self.city_onehot = keras.layers.CategoryEncoding(len(cities) + 1, "one_hot",
                                                         name="city_onehot")
        self.job_onehot = keras.layers.CategoryEncoding(len(jobs) + 1, "one_hot",
                                                        name="job_onehot")
        self.age_onehot = keras.layers.CategoryEncoding(AGE_BINS, "one_hot", name="age_onehot")
        # wide part: a linear model on one-hot features
        self.wide = keras.layers.Dense(1, name="wide")
        # deep part: embeddings + normalized numbers through an MLP
        self.city_embedding = keras.layers.Embedding(len(cities) + 1, 4, name="city_embedding")
        self.job_embedding = keras.layers.Embedding(len(jobs) + 1, 4, name="job_embedding")
        self.deep = DeepTower(name="deep")
        # two optimizers, as the premade WideDeepModel has
        self.wide_optimizer = keras.optimizers.SGD(0.05)
        self.deep_optimizer = keras.optimizers.Adam(0.01)

    def adapt(self, features):
        """Fit the preprocessing statistics to a dict of feature arrays."""
        self.numeric_norm.adapt(np.stack([features["age"], features["income"]], axis=-1))
        self.age_buckets.adapt(features["age"])

    def call(self, inputs):
        city = self.city_lookup(inputs["city"])
        job = self.job_lookup(inputs["job"])
        age = keras.ops.expand_dims(inputs["age"], -1)
        income = keras.ops.expand_dims(inputs["income"], -1)
        numeric = self.numeric_norm(keras.ops.concatenate([age, income], axis=-1))
        wide_features = keras.ops.concatenate([
            self.city_onehot(city), self.job_onehot(job),
            self.age_onehot(self.age_buckets(inputs["age"])),
        ], axis=-1)
        deep_features = keras.ops.concatenate(
            [self.city_embedding(city), self.job_embedding(job), numeric], axis=-1
        )
        return self.wide(wide_features) + self.deep(deep_features)

    @property
    def wide_variables(self):
        return self.wide.trainable_variables

    @property
    def deep_variables(self):
        return (self.city_embedding.trainable_variables
                + self.job_embedding.trainable_variables
                + self.deep.trainable_variables)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        wide_vars, deep_vars = self.wide_variables, self.deep_variables
        gradients = tape.gradient(loss, wide_vars + deep_vars)
        self.wide_optimizer.apply_gradients(zip(gradients[:len(wide_vars)], wide_vars))
        self.deep_optimizer.apply_gradients(zip(gradients[len(wide_vars):], deep_vars))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def make_data(samples=512, seed=0):
    """A dict of features (strings and floats) and a 0/1 label."""
    rng = np.random.default_rng(seed)
    features = {
        "city": rng.choice(CITIES, size=samples),
        "job": rng.choice(JOBS + ["unknown"], size=samples),  # an out-of-vocabulary value
        "age": rng.uniform(18, 70, size=samples).astype("float32"),
        "income": rng.lognormal(10, 0.5, size=samples).astype("float32"),
    }
    score = (
        (features["age"] > 40).astype("float32")
        + np.isin(features["city"], ["london", "paris"])
        + (features["job"] == "doctor")
        - 1.2
    )
    labels = (score + 0.3 * rng.normal(size=samples) > 0).astype("float32")[:, None]
    return features, labels


def make_dataset(features, labels, batch_size=64):
    """String features go through `tf.data` (Keras's array adapter takes numbers only)."""
    return tf.data.Dataset.from_tensor_slices((features, labels)).batch(batch_size)


def build_model(features=None):
    model = WideAndDeep()
    model.adapt(features if features is not None else make_data()[0])
    return model


def passes():
    return [kip.passes.Expand()]


def compile_model(model):
    # No optimizer here: train_step uses the model's own two optimizers.
    model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy(threshold=0.0)])


def main():
    keras.utils.set_random_seed(0)
    features, labels = make_data()
    model = kip.PluginModel(build_model(features), passes=passes())
    compile_model(model)
    history = model.fit(make_dataset(features, labels), epochs=3, verbose=2)
    print(model.kip_report)
    print(f"backend: {kip.backend()}")
    print(f"final loss: {history.history['loss'][-1]:.4f}")
    return history


if __name__ == "__main__":
    main()
