"""A differential fuzzer: random subclassed models trained by plain Keras and by kip.

Each case is drawn from one integer seed: a subclassed Keras model from a
grammar of idioms public models use, `fit` settings, passes and an entry
point. The case trains the model twice from the same seed and the same
initial weights, once with plain Keras and once through kip, and compares
every variable afterwards (trainable, non-trainable, seed-generator states,
variables `call` assigns, the optimizer's), and the `fit` history, to
`ATOL` (the tolerance `tests/passes/test_pass_training_equivalence.py` holds every
pass to under every precision policy). A case ends as

- ``pass``:    everything equal to `ATOL`;
- ``fail``:    a value differs, or kip raised an error that is not its own
               (a crash where plain Keras trained);
- ``refused``: kip raised one of its own errors (`keras_ipu_plugin.errors`),
               a clear refusal. Plain Keras trained every such case, so the
               summary lists them: a refusal is not a wrong result, but it
               is something a user cannot do;
- ``invalid``: plain Keras itself failed (the generator made a case Keras
               does not train); counted, never compared;
- ``documented``: a value differs through a difference kip documents
               (`DOCUMENTED`: microbatches seen by random layers and by
               layers writing variables in `call`, BatchNormalization
               included, or rounded per microbatch under a mixed policy;
               the float rounding of a TensorFlow graph rewrite,
               `GRAPH_REWRITES`), and the same case without it (for a
               rewrite: with that rewrite off on both sides) passes.

A failing case is shrunk: grammar elements and settings are dropped or set
back to their plain defaults one at a time while the case still fails, and
the smallest failing spec is printed as a one-line command.

Command line (from the repository root)::

    python -m tests.differential_fuzz --seed 17            # one case, shrunk if it fails
    python -m tests.differential_fuzz --cases 500 --start 0 --out runs.jsonl
    python -m tests.differential_fuzz --spec '{"model": ..., "fit": ..., "run": ...}'

The grammar (`generate_model`):

- inputs: one array, or a dict of two arrays, optionally with a padded token
  sequence read through `Embedding(mask_zero=True)` whose mask a
  `GlobalAveragePooling1D` honours (masks);
- outputs: one tensor, or a dict of two (with a dict of losses);
- body blocks, nested to depth 3: `Dense`; residual blocks (a custom layer,
  `x + f(x)`); custom container layers that pass `training=training` down
  (or leave it to Keras's call context); a `keras.Sequential` and a
  functional sub-model built in `__init__` or in `build()`; a layer shared
  by two calls; Python `if training:` around a `keras.random` draw or a
  Dropout; `Dropout`, `GaussianNoise`, `GaussianDropout` at any depth;
  `BatchNormalization` at any depth; a non-trainable variable that `call`
  assigns (`self.v.assign(...)`, `assign_add`); `tf.*` calls
  (`tf.nn.relu`, `tf.square`, `tf.reduce_mean`) and `keras.ops` calls
  (`tanh`, `sigmoid`, `concatenate`) in a `call`; a random layer held by no
  attribute (called, not owned, as a module-level augmentation `Sequential`).

What the generator cannot produce: convolutions, recurrent layers,
attention and image augmentation layers (`RandomFlip`, `RandomZoom`: the
body is two-dimensional, `(batch, width)`, apart from the masked token
branch); custom layers inside a `Sequential` or functional sub-model (their
blocks are Keras layers: a functional backbone of custom blocks passing
`training` down to `BatchNormalization` is out of reach); a layer shared
between two different owners (sharing is within one `call`); Python control flow on tensor values; variables
created after the first batch; `train_step` overrides; datasets that
`repeat()` with `steps_per_epoch`, and callbacks that stop training;
`MirroredStrategy`; string or ragged inputs.

`fit` settings (`generate_fit`): optimizer (SGD with momentum, Adam, AdamW,
RMSprop), batch size, a partial last batch, epochs, `initial_epoch`,
`steps_per_execution`, numpy or `tf.data` (unshuffled, seeded or unseeded
shuffle), numpy `shuffle=True`, validation data with `validation_freq`,
sample weights, class weights, precision policy (`float32`,
`mixed_float16`, `mixed_bfloat16`), `jit_compile`. Passes: `Expand`,
`Replace` (Dense by a Dense subclass, weights copied), `Outline` (after
`Expand`), `Recompute` by hand and `auto=True`, `PipelineStages` (two
stages, with or without two microbatches). Entry points:
`kip.PluginModel`, `kip.PluginCallback`, `kip.scope`.
"""

import argparse
import copy
import json
import os
import random
import re
import sys
import time
import traceback

if "tensorflow" not in sys.modules:
    # As tests/conftest.py: XLA must round as the graph says under mixed
    # precision, read once when XLA starts.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
        ).strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_ipu_plugin as kip  # noqa: E402
from keras_ipu_plugin import passes as kip_passes  # noqa: E402

layers = keras.layers
ops = keras.ops

# The weights of every pass are held to this against plain Keras under every
# precision policy (tests/passes/test_pass_training_equivalence.py); a wrong pass
# is 1e-3 to 1e-2 away.
ATOL = 1e-5
# Losses and metrics in the history: the same, relative to their size.
HISTORY_RTOL = 1e-5

FEATURES = {"a": 5, "b": 3}
VOCAB, LENGTH = 12, 6
CLASSES = 3

# -- the model grammar --------------------------------------------------------

LEAF_KINDS = ["dense", "dropout", "noise", "batchnorm"]
BLOCK_KINDS = [
    "dense", "dropout", "noise", "batchnorm", "residual", "container", "sequential",
    "functional", "shared", "if_training", "assign", "tf_ops", "keras_ops", "unowned",
]


def _leaf(rng, kind=None):
    kind = kind or rng.choice(LEAF_KINDS)
    block = {"kind": kind}
    if kind == "dense":
        block["activation"] = rng.choice(["relu", "tanh", None])
    elif kind == "dropout":
        block["rate"] = rng.choice([0.1, 0.3])
    elif kind == "noise":
        block["layer"] = rng.choice(["GaussianNoise", "GaussianDropout"])
    return block


def _block(rng, depth):
    kinds = BLOCK_KINDS if depth < 3 else LEAF_KINDS + ["tf_ops", "keras_ops", "assign"]
    kind = rng.choice(kinds)
    if kind in LEAF_KINDS:
        return _leaf(rng, kind)
    block = {"kind": kind}
    if kind in ("residual", "container"):
        block["children"] = [_block(rng, depth + 1) for _ in range(rng.randint(1, 3))]
        block["pass_training"] = rng.random() < 0.7
        if kind == "residual":
            block["norm"] = rng.random() < 0.5
    elif kind in ("sequential", "functional"):
        block["children"] = [_leaf(rng) for _ in range(rng.randint(1, 3))]
        if kind == "functional":
            block["in_build"] = rng.random() < 0.4
    elif kind == "if_training":
        block["variant"] = rng.choice(["random_normal", "dropout"])
    elif kind == "assign":
        block["variant"] = rng.choice(["moving_mean", "counter"])
    elif kind == "tf_ops":
        block["variant"] = rng.choice(["relu_square", "reduce_mean"])
    elif kind == "keras_ops":
        block["variant"] = rng.choice(["tanh_sigmoid", "concatenate"])
    elif kind == "unowned":
        block["layer"] = rng.choice(["GaussianNoise", "Dropout"])
    return block


def generate_model(rng):
    """A model spec: inputs, outputs, task and a body of nested blocks."""
    mask = rng.random() < 0.2
    spec = {
        "width": rng.choice([4, 8, 16]),
        "inputs": "dict" if mask or rng.random() < 0.3 else "array",
        "mask": mask,
        "outputs": "dict" if rng.random() < 0.25 else "single",
        "task": rng.choice(["regression", "classification"]),
        "body": [_block(rng, 1) for _ in range(rng.randint(1, 4))],
    }
    return spec


def generate_fit(rng, model_spec):
    """`fit` settings; class weights only where Keras takes them (one
    classification output)."""
    batch_size = rng.choice([4, 8])
    batches = rng.randint(2, 6)
    partial = rng.random() < 0.3
    data = rng.choice(["numpy", "dataset"])
    single_class = model_spec["outputs"] == "single" and model_spec["task"] == "classification"
    settings = {
        "optimizer": rng.choice(["sgd", "adam", "adamw", "rmsprop"]),
        "batch_size": batch_size,
        "samples": batches * batch_size - (rng.randint(1, batch_size - 1) if partial else 0),
        "epochs": rng.choice([1, 2]),
        "initial_epoch": rng.choice([0, 0, 1]),
        # Rarer than the other settings: it is one setting, and a difference
        # it makes would hide what else a case shows.
        "steps_per_execution": rng.choice([1] * 6 + [2, 3]),
        "data": data,
        "shuffle": (rng.choice([False, True]) if data == "numpy"
                    else rng.choice(["none", "seeded", "unseeded"])),
        "validation": rng.random() < 0.3,
        "validation_freq": rng.choice([1, 2]),
        "sample_weight": rng.random() < 0.2,
        "class_weight": single_class and rng.random() < 0.3,
        "policy": rng.choice(["float32"] * 4 + ["mixed_float16", "mixed_bfloat16"]),
        "jit_compile": rng.random() < 0.2,
    }
    # Keras takes one or the other.
    settings["sample_weight"] = settings["sample_weight"] and not settings["class_weight"]
    return settings


PASS_NAMES = ["expand", "replace", "outline", "recompute_hand", "recompute_auto",
              "stages", "stages_microbatched"]


def generate_run(rng):
    """Entry point and passes (none in a fifth of the cases)."""
    if rng.random() < 0.2:
        passes = []
    else:
        passes = [rng.choice(PASS_NAMES)]
        if rng.random() < 0.2:
            second = rng.choice(PASS_NAMES)
            if second != passes[0]:
                passes.append(second)
    return {"entry": rng.choice(["plugin", "callback", "scope"]), "passes": passes,
            "verify": rng.random() < 0.8}


def generate_case(seed):
    """The whole case drawn from `seed`: {"seed", "model", "fit", "run"}."""
    rng = random.Random(seed)
    model = generate_model(rng)
    return {"seed": seed, "model": model, "fit": generate_fit(rng, model), "run": generate_run(rng)}


# -- building a model from a spec ---------------------------------------------


class FuzzDense(layers.Dense):
    """The Dense subclass `Replace` swaps in (weights copied)."""


def _leaf_layer(block, width, name):
    kind = block["kind"]
    if kind == "dense":
        return layers.Dense(width, activation=block["activation"], name=name)
    if kind == "dropout":
        return layers.Dropout(block["rate"], name=name)
    if kind == "noise":
        return getattr(layers, block["layer"])(0.1, name=name)
    if kind == "batchnorm":
        return layers.BatchNormalization(name=name)
    raise ValueError(kind)


def _op(variant, x):
    """The `tf.*` and `keras.ops` calls a `call` makes (width kept)."""
    if variant == "relu_square":
        return tf.nn.relu(x) + 0.1 * tf.square(x)
    if variant == "reduce_mean":
        return x - tf.reduce_mean(x, axis=-1, keepdims=True)
    if variant == "tanh_sigmoid":
        return ops.tanh(x) * ops.sigmoid(x)
    raise ValueError(variant)


# Layers called in `call` but held by no attribute of the model (as a
# module-level augmentation Sequential): one per model, found by its id.
_UNOWNED = {}


class Program(layers.Layer):
    """Runs a list of blocks in order: the body of the model and of every
    container. Layers live in `self.blocks` (a tracked list, named
    `blocks.0`, ...); ops and sharing are steps of `self.steps`."""

    def __init__(self, blocks, width, pass_training=True, **kwargs):
        super().__init__(**kwargs)
        self.width = width
        self.pass_training = pass_training
        blocks, steps = _compile_blocks(blocks, width, self)
        self.blocks = blocks
        self.steps_json = json.dumps(steps)

    @property
    def steps(self):
        return [tuple(step) for step in json.loads(self.steps_json)]

    def call(self, x, training=None):
        return _run_steps(self, x, training)


def _compile_blocks(blocks, width, owner):
    owned, steps = [], []
    for block in blocks:
        kind = block["kind"]
        if kind in LEAF_KINDS:
            owned.append(_leaf_layer(block, width, None))
            steps.append(("layer", len(owned) - 1))
        elif kind in ("residual", "container"):
            owned.append((Residual if kind == "residual" else Container)(block, width))
            steps.append(("layer", len(owned) - 1))
        elif kind == "sequential":
            owned.append(keras.Sequential(
                [_leaf_layer(child, width, None) for child in block["children"]]))
            steps.append(("layer", len(owned) - 1))
        elif kind == "functional":
            owned.append(FunctionalInBuild(block, width) if block["in_build"]
                         else _functional(block["children"], width))
            steps.append(("layer", len(owned) - 1))
        elif kind == "shared":
            owned.append(layers.Dense(width))
            steps += [("layer", len(owned) - 1), ("op", "tanh_sigmoid"),
                      ("layer", len(owned) - 1)]
        elif kind == "if_training":
            owned.append(IfTraining(block["variant"]))
            steps.append(("layer", len(owned) - 1))
        elif kind == "assign":
            owned.append(Assigns(block["variant"]))
            steps.append(("layer", len(owned) - 1))
        elif kind in ("tf_ops", "keras_ops"):
            if block["variant"] == "concatenate":
                owned.append(layers.Dense(width))
                steps.append(("concatenate", len(owned) - 1))
            else:
                steps.append(("op", block["variant"]))
        elif kind == "unowned":
            key = f"{id(owner)}.{len(steps)}"
            _UNOWNED[key] = getattr(layers, block["layer"])(0.2)
            steps.append(("unowned", key))
        else:
            raise ValueError(kind)
    return owned, steps


def _run_steps(owner, x, training):
    for step, where in owner.steps:
        if step == "layer":
            layer = owner.blocks[where]
            x = layer(x, training=training) if owner.pass_training else layer(x)
        elif step == "op":
            x = _op(where, x)
        elif step == "concatenate":
            x = owner.blocks[where](ops.concatenate([x, ops.tanh(x)], axis=-1))
        elif step == "unowned":
            x = _UNOWNED[where](x, training=training)
    return x


def _functional(children, width):
    inputs = keras.Input((width,))
    x = inputs
    for child in children:
        x = _leaf_layer(child, width, None)(x)
    return keras.Model(inputs, x)


class Container(Program):
    """A custom layer holding blocks, passing `training` down or not."""

    def __init__(self, block, width, **kwargs):
        super().__init__(block["children"], width, block["pass_training"], **kwargs)


class Residual(Container):
    """`x + f(x)`, optionally normalised after the sum."""

    def __init__(self, block, width, **kwargs):
        super().__init__(block, width, **kwargs)
        self.norm = layers.LayerNormalization() if block["norm"] else None

    def call(self, x, training=None):
        y = x + _run_steps(self, x, training)
        return self.norm(y) if self.norm is not None else y


class FunctionalInBuild(layers.Layer):
    """A functional sub-model built in `build()` (as keras.io's Perceiver does)."""

    def __init__(self, block, width, **kwargs):
        super().__init__(**kwargs)
        self.children_json = json.dumps(block["children"])
        self.width = width

    def build(self, input_shape):
        self.inner = _functional(json.loads(self.children_json), self.width)

    def call(self, x, training=None):
        return self.inner(x, training=training)


class IfTraining(layers.Layer):
    """Python `if training:` around a random draw or a Dropout."""

    def __init__(self, variant, **kwargs):
        super().__init__(**kwargs)
        self.variant = variant
        if variant == "random_normal":
            self.seed_generator = keras.random.SeedGenerator(3)
        else:
            self.dropout = layers.Dropout(0.2)

    def call(self, x, training=None):
        if training:
            if self.variant == "random_normal":
                return x + 0.1 * keras.random.normal(ops.shape(x), seed=self.seed_generator,
                                                     dtype=x.dtype)
            return self.dropout(x, training=training)
        return x


class Assigns(layers.Layer):
    """A non-trainable variable written in `call`: a moving mean of the
    input (read before it is written) or a step counter."""

    def __init__(self, variant, **kwargs):
        super().__init__(**kwargs)
        self.variant = variant

    def build(self, input_shape):
        self.v = self.add_weight(shape=(input_shape[-1],), initializer="zeros",
                                 trainable=False, name="v")
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                     name="count")

    def call(self, x, training=None):
        y = x - ops.cast(self.v, x.dtype)
        if training:
            if self.variant == "moving_mean":
                mean = ops.cast(ops.mean(x, axis=0), self.v.dtype)
                self.v.assign(0.9 * self.v + 0.1 * mean)
            else:
                self.count.assign_add(1.0)
        return y


class FuzzModel(keras.Model):
    """The subclassed model a spec describes."""

    def __init__(self, spec, **kwargs):
        super().__init__(**kwargs)
        # Kept as text: Keras would wrap a dict attribute in its own tracking.
        self.spec_json = json.dumps(spec)
        width = spec["width"]
        if spec["inputs"] == "dict":
            self.stem_a = layers.Dense(width, name="stem_a")
            self.stem_b = layers.Dense(width, name="stem_b")
        else:
            self.stem = layers.Dense(width, name="stem")
        if spec["mask"]:
            self.embed = layers.Embedding(VOCAB, width, mask_zero=True, name="embed")
            self.pool = layers.GlobalAveragePooling1D(name="pool")
        self.body = Program(spec["body"], width, name="body")
        out = CLASSES if spec["task"] == "classification" else 1
        # A float32 head, as the mixed precision guide recommends.
        self.head = layers.Dense(out, dtype="float32", name="head")
        if spec["outputs"] == "dict":
            self.aux = layers.Dense(1, dtype="float32", name="aux")

    @property
    def spec(self):
        return json.loads(self.spec_json)

    def call(self, inputs, training=None):
        if self.spec["inputs"] == "dict":
            h = self.stem_a(inputs["a"]) + self.stem_b(inputs["b"])
        else:
            h = self.stem(inputs)
        if self.spec["mask"]:
            h = h + self.pool(self.embed(inputs["tokens"]))
        h = self.body(h, training=training)
        if self.spec["outputs"] == "dict":
            return {"main": self.head(h), "aux": self.aux(h)}
        return self.head(h)


# -- data -------------------------------------------------------------------


def make_data(model_spec, fit_spec, seed, samples=None):
    """(x, y, sample_weight) as numpy, from `seed`."""
    rng = np.random.default_rng(seed)
    n = samples or fit_spec["samples"]
    if model_spec["inputs"] == "dict":
        x = {key: rng.normal(size=(n, size)).astype("float32")
             for key, size in FEATURES.items()}
        if model_spec["mask"]:
            tokens = rng.integers(1, VOCAB, size=(n, LENGTH)).astype("int32")
            lengths = rng.integers(1, LENGTH + 1, size=n)
            tokens[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
            x["tokens"] = tokens
    else:
        x = rng.normal(size=(n, FEATURES["a"])).astype("float32")
    if model_spec["task"] == "classification":
        main = rng.integers(0, CLASSES, size=(n, 1)).astype("int32")
    else:
        main = rng.normal(size=(n, 1)).astype("float32")
    y = ({"main": main, "aux": rng.normal(size=(n, 1)).astype("float32")}
         if model_spec["outputs"] == "dict" else main)
    weights = rng.uniform(0.5, 2.0, size=(n,)).astype("float32")
    return x, y, weights


def _first(x, count):
    return {k: v[:count] for k, v in x.items()} if isinstance(x, dict) else x[:count]


# -- one case -----------------------------------------------------------------


def _passes(names, model):
    made = []
    for name in names:
        if name == "expand":
            made.append(kip_passes.Expand("all"))
        elif name == "replace":
            made.append(kip_passes.Replace(
                {layers.Dense: kip_passes.Replacement(FuzzDense, copy_weights=True)}))
        elif name == "outline":
            made += [kip_passes.Expand("all"), kip_passes.Outline(layers.Dense)]
        elif name == "recompute_hand":
            made.append(kip_passes.Recompute(["stem_a" if model.spec["inputs"] == "dict"
                                              else "stem", "body"]))
        elif name == "recompute_auto":
            made.append(kip_passes.Recompute(auto=True))
        elif name == "stages":
            made.append(kip_passes.PipelineStages(num_stages=2))
        elif name == "stages_microbatched":
            made.append(kip_passes.PipelineStages(num_stages=2, microbatches=2))
        else:
            raise ValueError(name)
    return made


def _optimizer(name):
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate=0.01)
    if name == "adamw":
        return keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)
    return keras.optimizers.RMSprop(learning_rate=0.01)


def _loss(model_spec):
    main = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            if model_spec["task"] == "classification" else keras.losses.MeanSquaredError())
    if model_spec["outputs"] == "dict":
        return {"main": main, "aux": keras.losses.MeanSquaredError()}
    return main


def _dataset(x, y, weights, fit_spec, seed):
    elements = (x, y, weights) if fit_spec["sample_weight"] else (x, y)
    ds = tf.data.Dataset.from_tensor_slices(elements)
    if fit_spec["shuffle"] == "seeded":
        ds = ds.shuffle(64, seed=seed % 1000)
    elif fit_spec["shuffle"] == "unseeded":
        ds = ds.shuffle(64)
    return ds.batch(fit_spec["batch_size"])


def _converted(model, trainee, callbacks):
    """The functional model kip trains, whichever entry point made it."""
    for holder in [trainee, *callbacks]:
        if getattr(holder, "converted", None) is not None:
            return holder.converted
    from keras_ipu_plugin.training import scope as scope_module

    session = scope_module._sessions.get(model)
    return None if session is None else session.converted


def _variables(model, converted, optimizer, unowned_keys):
    """Every variable by a stable key: the model's (paths made unique by
    their order; a layer `Replace` swapped out by the layer that trained in
    its place), the unowned layers' and the optimizer's."""
    values = {}
    replaced = {}
    if converted is not None:
        for old, new in getattr(converted, "kip_replaced", ()):
            by_name = {v.name: v for v in new.weights}
            for variable in old.weights:
                if variable.name in by_name:
                    replaced[id(variable)] = by_name[variable.name]
    renames = {}
    for variable in model.variables:
        key = variable.path
        while key in values:
            key += "+"
        trained = replaced.get(id(variable), variable)
        values[key] = np.asarray(trained.numpy(), dtype="float32")
        if trained is not variable:
            renames[trained.path.replace("/", "_")] = variable.path.replace("/", "_")
    for index, key in enumerate(unowned_keys):
        for variable in _UNOWNED[key].variables:
            values[f"unowned.{index}/{variable.name}"] = variable.numpy().astype("float32")
    for variable in optimizer.variables:
        name = variable.name
        for new, old in renames.items():
            if name.startswith(new):
                name = old + name[len(new):]
        key = "optimizer/" + name
        while key in values:
            key += "+"
        values[key] = np.asarray(variable.numpy(), dtype="float32")
    return values


def train(case, use_kip):
    """Train the case's model once; return (variables, history).

    Plain Keras when `use_kip` is false; otherwise through the case's entry
    point and passes. Both sides start from the same weights (built, then
    set from the seed's initial weights) and the same global seed at `fit`.
    """
    model_spec, fit_spec, run_spec = case["model"], case["fit"], case["run"]
    seed = case["seed"]
    keras.backend.clear_session(free_memory=False)
    _UNOWNED.clear()
    previous_policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy(fit_spec["policy"])
    previous_rewrites = _rewrites_off(run_spec.get("graph_rewrites_off", ()))
    try:
        x, y, weights = make_data(model_spec, fit_spec, seed)
        keras.utils.set_random_seed(seed)
        entry = run_spec["entry"] if use_kip else "plain"
        scope = None
        if entry == "scope":
            # The model is made and compiled inside the scope, as the README shows.
            scope = kip.scope(passes=_passes(run_spec["passes"], _Spec(model_spec)),
                              verify=run_spec["verify"])
            scope.__enter__()
        try:
            model = FuzzModel(model_spec, name="fuzz_model")
            model(_first(x, 2))
            keras.utils.set_random_seed(seed)
            initial = [np.asarray(w) for w in _initial_weights(case)]
            model.set_weights(initial)
            callbacks = []
            trainee = model
            if entry == "plugin":
                trainee = kip.PluginModel(model, passes=_passes(run_spec["passes"], model),
                                          verify=run_spec["verify"])
            elif entry == "callback":
                callbacks.append(kip.PluginCallback(passes=_passes(run_spec["passes"], model),
                                                    verify=run_spec["verify"]))
            trainee.compile(optimizer=_optimizer(fit_spec["optimizer"]), loss=_loss(model_spec),
                            steps_per_execution=fit_spec["steps_per_execution"],
                            jit_compile=fit_spec["jit_compile"])
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)
        kwargs = {"epochs": fit_spec["initial_epoch"] + fit_spec["epochs"],
                  "initial_epoch": fit_spec["initial_epoch"], "verbose": 0,
                  "callbacks": callbacks}
        if fit_spec["class_weight"]:
            kwargs["class_weight"] = {0: 1.0, 1: 2.0, 2: 0.5}
        if fit_spec["validation"]:
            vx, vy, _ = make_data(model_spec, fit_spec, seed + 1, samples=fit_spec["batch_size"] + 2)
            kwargs["validation_data"] = (vx, vy)
            kwargs["validation_freq"] = fit_spec["validation_freq"]
        keras.utils.set_random_seed(seed + 2)
        if fit_spec["data"] == "numpy":
            kwargs.update(batch_size=fit_spec["batch_size"], shuffle=fit_spec["shuffle"])
            if fit_spec["sample_weight"]:
                kwargs["sample_weight"] = weights
            history = trainee.fit(x, y, **kwargs)
        else:
            history = trainee.fit(_dataset(x, y, weights, fit_spec, seed), **kwargs)
        unowned = list(_UNOWNED)
        converted = _converted(model, trainee, callbacks) if use_kip else None
        return _variables(model, converted, trainee.optimizer, unowned), history.history
    finally:
        keras.config.set_dtype_policy(previous_policy)
        tf.config.optimizer.set_experimental_options(previous_rewrites)


def _rewrites_off(names):
    """Turn TensorFlow's graph rewrites `names` (grappler options such as
    "arithmetic_optimization") off for both runs of a case; return the
    settings to put back. The functions `fit` traces afterwards read them."""
    current = tf.config.optimizer.get_experimental_options()
    previous = {name: current.get(name, True) for name in names}
    tf.config.optimizer.set_experimental_options({name: False for name in names})
    return previous


class _Spec:
    """What `_passes` reads of a model before there is one (kip.scope)."""

    def __init__(self, spec):
        self.spec = spec


_INITIAL = {}


def _initial_weights(case):
    """The initial weights of the case's model: one build, kept, so both
    sides start equal whatever order their layers are built in."""
    key = json.dumps([case["seed"], case["model"], case["fit"]["policy"]], sort_keys=True)
    if key not in _INITIAL:
        _INITIAL.clear()
        unowned = dict(_UNOWNED)
        x, _, _ = make_data(case["model"], case["fit"], case["seed"])
        keras.utils.set_random_seed(case["seed"])
        model = FuzzModel(case["model"], name="fuzz_model")
        model(_first(x, 2))
        _INITIAL[key] = [np.array(w) for w in model.get_weights()]
        _UNOWNED.clear()
        _UNOWNED.update(unowned)
    return _INITIAL[key]


#: kip's documented refusals that reach the user as TensorFlow's or
#: Python's own errors: a batch of fewer rows than its microbatches (a
#: partial last batch of one row, with two) is refused as the step is traced
#: where its size is known, else by a graph-mode assertion inside the traced
#: step; under XLA, which drops assertions, it trains (docs/reference.md,
#: Pipelined training).
DOCUMENTED_REFUSALS = ("microbatches, so a microbatch would be empty",)


def _is_kip_error(error):
    return (type(error).__module__.startswith("keras_ipu_plugin")
            or any(text in str(error) for text in DOCUMENTED_REFUSALS))


def compare(expected, actual):
    """The differences between two runs: a list of strings, empty if equal."""
    (plain, plain_history), (mine, my_history) = expected, actual
    problems = []
    if plain.keys() != mine.keys():
        problems.append(
            f"variables differ: only plain Keras has {sorted(plain.keys() - mine.keys())[:5]}, "
            f"only kip has {sorted(mine.keys() - plain.keys())[:5]}")
    for key in sorted(plain.keys() & mine.keys()):
        a, b = plain[key], mine[key]
        if a.shape != b.shape:
            problems.append(f"{key}: shape {b.shape} against plain Keras's {a.shape}")
            continue
        difference = float(np.max(np.abs(a - b))) if a.size else 0.0
        if not difference <= ATOL:
            problems.append(f"{key}: max abs difference {difference:.3g} from plain Keras")
    if plain_history.keys() != my_history.keys():
        problems.append(f"history keys {sorted(my_history)} against plain Keras's "
                        f"{sorted(plain_history)}")
    for key in sorted(plain_history.keys() & my_history.keys()):
        a, b = np.asarray(plain_history[key]), np.asarray(my_history[key])
        if a.shape != b.shape or not np.allclose(b, a, rtol=HISTORY_RTOL, atol=ATOL):
            problems.append(f"history[{key!r}]: {b.tolist()} against plain Keras's {a.tolist()}")
    return problems


def run_case(case, train_fn=None):
    """Train plain Keras and kip (with `train_fn`, `train` by default);
    return {"status", "detail", "seconds"}."""
    train_fn = train_fn or train
    started = time.monotonic()
    try:
        plain = train_fn(case, use_kip=False)
    except Exception as error:  # noqa: BLE001 - a case Keras itself refuses
        return {"status": "invalid", "detail": f"plain Keras: {type(error).__name__}: "
                f"{_short(error)}", "seconds": time.monotonic() - started}
    diverged = [key for key, value in plain[0].items() if not np.all(np.isfinite(value))]
    if diverged:
        # NaN on both sides would compare as a difference, and equal NaNs
        # would hide one: a case that cannot show a difference is no case.
        return {"status": "invalid", "detail": f"plain Keras diverged: {diverged[0]} is not "
                "finite", "seconds": time.monotonic() - started}
    try:
        mine = train_fn(case, use_kip=True)
    except Exception as error:  # noqa: BLE001
        if _is_kip_error(error):
            status = "refused"
        else:
            status = "fail"
        detail = f"{type(error).__name__}: {_short(error)}"
        if status == "fail":
            detail += "\n" + "".join(traceback.format_exception(error)[-6:])
        return {"status": status, "detail": detail, "seconds": time.monotonic() - started}
    problems = compare(plain, mine)
    status, detail = ("fail" if problems else "pass"), "\n".join(problems[:12])
    cause = documented_cause(case, _max_difference(plain[0], mine[0]))
    if problems and cause is not None:
        # The difference kip documents, if the case without it is exact.
        without = run_case(without_suspect(case, cause), train_fn)
        if without["status"] == "pass":
            status, detail = "documented", f"{DOCUMENTED[cause]}\n{detail}"
    if status == "fail" and not problems[0].startswith(("variables differ", "history keys")):
        causes = _rounding_cause(case, train_fn)
        if causes:
            status = "documented"
            detail = "\n".join([DOCUMENTED[cause] for cause in causes] + [detail])
    return {"status": status, "detail": detail, "seconds": time.monotonic() - started}


def _rounding_cause(case, train_fn):
    """The graph rewrites (`GRAPH_REWRITES`) whose float rounding alone makes
    `case` differ: the first of them, or all of them together, without
    which the same case passes; an empty list if none does."""
    if case["run"].get("graph_rewrites_off"):
        return []
    causes = [cause for cause in GRAPH_REWRITES
              if cause != "recompute_fusion"
              or {"recompute_hand", "recompute_auto"} & set(case["run"]["passes"])]
    tries = [[cause] for cause in causes] + ([causes] if len(causes) > 1 else [])
    for chosen in tries:
        smaller = case
        for cause in chosen:
            smaller = without_suspect(smaller, cause)
        if run_case(smaller, train_fn)["status"] == "pass":
            return chosen
    return []


#: Differences from plain Keras that kip documents (docs/reference.md,
#: "Pipelined training"): a case that differs only through one of them ends
#: as "documented", not "fail".
DOCUMENTED = {
    "microbatches": "documented: in a pipeline random layers draw, and BatchNormalization "
                    "and other variables a `call` writes are updated, once per microbatch; "
                    "under a mixed precision policy each microbatch's gradients are rounded "
                    "before the sum (docs/reference.md, Pipelined training)",
}


#: TensorFlow's graph rewrites (grappler options) that reorder or fuse float
#: operations by the graph's op names and shapes, not by what the model
#: computes; kip's graph computes the same operations as plain Keras, but
#: under other op names (and, with Recompute, with other readers of an
#: intermediate), so a rewrite may round differently (docs/reference.md,
#: "Float rounding TensorFlow's graph optimiser chooses"). A difference is
#: put down to one only when the same case, with that rewrite off on both
#: sides, passes.
GRAPH_REWRITES = {
    "add_order": "arithmetic_optimization",
    "recompute_fusion": "remapping",
}

DOCUMENTED.update({
    "add_order": "documented: TensorFlow's arithmetic optimizer merges a chain of adds "
                 "(nested residual connections) into one AddN whose operands it sorts by op "
                 "name; kip's ops are named by the functional model's layers, plain Keras's "
                 "by nested name scopes, so the sum rounds differently (docs/reference.md, "
                 "Float rounding TensorFlow's graph optimiser chooses); the same case with "
                 "that rewrite off passes",
    "recompute_fusion": "documented: in a recomputed segment TensorFlow's remapper fuses a "
                        "MatMul with the elementwise ops after it (its bias, an activation) "
                        "where the forward pass, whose intermediate has more readers, does "
                        "not, so the recomputation rounds once where the forward pass rounded "
                        "twice (docs/reference.md, Float rounding "
                        "TensorFlow's graph optimiser chooses); the same case with that "
                        "rewrite off passes",
})


#: Under a mixed precision policy each microbatch's gradients are rounded
#: to float16 / bfloat16 before they are summed: differences of that size
#: (over a few optimizer steps) are documented, larger ones are not.
MIXED_MICROBATCH_ATOL = 1e-2


def documented_cause(case, difference=0.0):
    """The documented difference `case` holds (a key of `DOCUMENTED`), or
    None: microbatches where a layer sees them (a random layer draws per
    microbatch; BatchNormalization and a layer assigning a variable in
    `call` update it per microbatch), or under a mixed precision policy
    where the largest `difference` is of the size of its rounding."""
    if "stages_microbatched" not in case["run"]["passes"]:
        return None
    if _has(case["model"]["body"], RANDOM_KINDS | {"batchnorm", "assign"}):
        return "microbatches"
    if case["fit"]["policy"] != "float32" and difference <= MIXED_MICROBATCH_ATOL:
        return "microbatches"
    return None


def _max_difference(plain, mine):
    """The largest absolute difference over the variables both runs hold."""
    differences = [float(np.max(np.abs(plain[key] - mine[key])))
                   for key in plain.keys() & mine.keys()
                   if plain[key].shape == mine[key].shape and plain[key].size]
    return max(differences, default=0.0)


RANDOM_KINDS = {"dropout", "noise", "if_training", "unowned"}


def _has(blocks, kinds):
    return any(b["kind"] in kinds or _has(b.get("children", ()), kinds) for b in blocks)


def known_suspects(case):
    """The case's elements that are known to make kip differ from plain
    Keras (see docs/differential-fuzzing.md): a failing case with none of
    them is a new finding."""
    model, fit, run = case["model"], case["fit"], case["run"]
    suspects = []
    if fit["steps_per_execution"] > 1:
        suspects.append("steps_per_execution")
    if {"expand", "outline"} & set(run["passes"]) and _has(model["body"], {"batchnorm"}):
        suspects.append("batchnorm_after_expand")
    if _has(model["body"], RANDOM_KINDS):
        suspects.append("random_streams")
    if fit["data"] == "dataset" and fit["shuffle"] in ("seeded", "unseeded"):
        suspects.append("dataset_shuffle")
    if ({"recompute_hand", "recompute_auto"} & set(run["passes"])
            and fit["optimizer"] in ("adam", "adamw", "rmsprop")):
        suspects.append("recompute_rounding")
    if fit["policy"] != "float32":
        suspects.append("mixed_precision")
    if "stages_microbatched" in run["passes"]:
        # Documented: BatchNormalization sees a microbatch, as in GPipe.
        suspects.append("microbatches")
    return suspects


def _without_random(blocks):
    kept = []
    for block in blocks:
        if block["kind"] in RANDOM_KINDS:
            continue
        if block.get("children"):
            block = dict(block, children=_without_random(block["children"]))
        kept.append(block)
    return kept or [{"kind": "dense", "activation": None}]


def without_suspect(case, suspect):
    """`case` with one known suspect (see `known_suspects`) taken out."""
    smaller = copy.deepcopy(case)
    fit, run = smaller["fit"], smaller["run"]
    if suspect == "steps_per_execution":
        fit["steps_per_execution"] = 1
    elif suspect == "batchnorm_after_expand":
        run["passes"] = [p for p in run["passes"] if p not in ("expand", "outline")]
    elif suspect == "random_streams":
        smaller["model"]["body"] = _without_random(smaller["model"]["body"])
    elif suspect == "dataset_shuffle":
        fit["shuffle"] = "none"
    elif suspect == "recompute_rounding":
        fit["optimizer"] = "sgd"
    elif suspect == "mixed_precision":
        fit["policy"] = "float32"
    elif suspect == "microbatches":
        run["passes"] = [p if p != "stages_microbatched" else "stages" for p in run["passes"]]
    elif suspect in GRAPH_REWRITES:
        run["graph_rewrites_off"] = sorted(
            set(run.get("graph_rewrites_off", ())) | {GRAPH_REWRITES[suspect]})
    else:
        raise ValueError(suspect)
    return smaller


def attribute(case, status, run=None):
    """Which known suspects the failure needs: {suspect: status without it},
    and under "none" the status with all of them taken out (a failure there
    is a new finding)."""
    run = run or run_case
    suspects = known_suspects(case)
    found = {}
    for suspect in suspects:
        found[suspect] = run(without_suspect(case, suspect))["status"]
    if suspects:
        bare = case
        for suspect in suspects:
            bare = without_suspect(bare, suspect)
        found["none"] = run(bare)["status"]
    return found


def _short(error, limit=600):
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + " ..."


# -- shrinking ------------------------------------------------------------------

FIT_DEFAULTS = {
    "optimizer": "sgd", "epochs": 1, "initial_epoch": 0, "steps_per_execution": 1,
    "validation": False, "validation_freq": 1,
    "sample_weight": False, "class_weight": False, "policy": "float32", "jit_compile": False,
}


def _body_reductions(blocks):
    """Each way of making a list of blocks smaller by one step."""
    for index, block in enumerate(blocks):
        if len(blocks) > 1:
            yield blocks[:index] + blocks[index + 1:]
        children = block.get("children")
        if children:
            # The block replaced by its children, then each child shrunk.
            if block["kind"] in ("residual", "container"):
                yield blocks[:index] + children + blocks[index + 1:]
            for smaller in _body_reductions(children):
                yield blocks[:index] + [dict(block, children=smaller)] + blocks[index + 1:]
        if block["kind"] not in ("dense",) and len(blocks) == 1:
            yield [{"kind": "dense", "activation": None}]


def candidates(case):
    """Smaller cases, one change each: settings back to their defaults,
    passes dropped, model elements dropped."""
    run = case["run"]
    if run["entry"] != "plugin":
        yield _with(case, "run", entry="plugin")
    if len(run["passes"]) > 1:
        for index in range(len(run["passes"])):
            yield _with(case, "run", passes=run["passes"][:index] + run["passes"][index + 1:])
    if len(run["passes"]) == 1:
        yield _with(case, "run", passes=[])
    if run["verify"]:
        yield _with(case, "run", verify=False)
    fit = case["fit"]
    for key, default in FIT_DEFAULTS.items():
        if fit[key] != default:
            yield _with(case, "fit", **{key: default})
    # Data and its shuffle change together: a dataset shuffles in the
    # pipeline ("none", "seeded", "unseeded"), numpy in `fit` (a bool).
    if fit["data"] != "numpy":
        yield _with(case, "fit", data="numpy", shuffle=False)
    if fit["shuffle"] not in (False, "none"):
        yield _with(case, "fit", shuffle=False if fit["data"] == "numpy" else "none")
    full = -(-fit["samples"] // fit["batch_size"]) * fit["batch_size"]
    if fit["samples"] != full:
        yield _with(case, "fit", samples=full)
    if fit["samples"] > 2 * fit["batch_size"]:
        yield _with(case, "fit", samples=fit["samples"] - fit["batch_size"])
    model = case["model"]
    for smaller in _body_reductions(model["body"]):
        yield _with(case, "model", body=smaller)
    if model["mask"]:
        yield _with(case, "model", mask=False)
    if model["inputs"] == "dict" and not model["mask"]:
        yield _with(case, "model", inputs="array")
    if model["outputs"] == "dict":
        yield _with(case, "model", outputs="single")
    if model["task"] == "classification" and not fit["class_weight"]:
        yield _with(case, "model", task="regression")
    if model["width"] != 4:
        yield _with(case, "model", width=4)


def _with(case, part, **changes):
    smaller = copy.deepcopy(case)
    smaller[part].update(changes)
    return smaller


def shrink(case, status, budget=40, log=print, run=None):
    """The smallest case found (greedily, within `budget` runs of `run`,
    `run_case` by default) that still ends with `status`."""
    run = run or run_case
    runs = 0
    improved = True
    while improved and runs < budget:
        improved = False
        for candidate in candidates(case):
            if runs >= budget:
                break
            runs += 1
            result = run(candidate)
            if result["status"] == status:
                case = candidate
                improved = True
                log(f"  shrunk ({runs} runs): {_describe(case)}")
                break
    return case


def _describe(case):
    return json.dumps({k: case[k] for k in ("model", "fit", "run")}, separators=(",", ":"))


def command_for(case):
    """The one-line command that runs `case` (its seed with the spec)."""
    return ("python -m tests.differential_fuzz --seed {} --spec '{}'".format(
        case["seed"], _describe(case)))


# -- command line ---------------------------------------------------------------


def summarize(path):
    """A Markdown summary of the JSON lines `--out` wrote: counts, then the
    failing, refused and invalid seeds with their known suspects."""
    records = {}
    with open(path) as lines:
        for line in lines:
            record = json.loads(line)
            records[record["seed"]] = record  # a seed run twice: the last run
    counts = {}
    for record in records.values():
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    seconds = sum(r["seconds"] for r in records.values())
    out = [f"{len(records)} cases (seeds {min(records)}-{max(records)}), "
           f"{seconds / 60:.0f} min of case time: "
           + ", ".join(f"{counts[k]} {k}" for k in sorted(counts)), ""]
    for status in ("fail", "refused", "invalid", "documented"):
        chosen = [r for r in records.values() if r["status"] == status]
        if not chosen:
            continue
        out += [f"### {status} ({len(chosen)})", "",
                "| seed | entry, passes | known suspects | first difference or error |",
                "|---|---|---|---|"]
        for r in sorted(chosen, key=lambda r: r["seed"]):
            run = r["case"]["run"]
            first = (r["detail"].splitlines() or [""])[0].replace("|", "\\|")[:160]
            suspects = known_suspects({"seed": r["seed"], **r["case"]})
            if status == "fail" and _documented_when_rerun(r):
                # A run of code before the "documented" status: the case
                # holds a documented cause, which a rerun of the seed checks.
                suspects = [s + " (documented: rerun to confirm)" if s == "microbatches"
                            else s for s in suspects]
            if status == "fail" and any(text in r["detail"] for text in DOCUMENTED_REFUSALS):
                first = "(a documented refusal, refused when rerun) " + first
            out.append(f"| {r['seed']} | {run['entry']}, {'+'.join(run['passes']) or '-'} | "
                       f"{', '.join(suspects) or '**none**'} | {first} |")
        out.append("")
    return "\n".join(out)


def _documented_when_rerun(record):
    """Whether a failing record of a run holds a documented cause (see
    `documented_cause`; the largest difference is read from its detail)."""
    sizes = [float(m) for m in re.findall(r"max abs difference ([0-9.e+-]+)", record["detail"])]
    difference = max(sizes) if sizes else float("inf")
    return documented_cause({"seed": record["seed"], **record["case"]}, difference) is not None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="run the case of this seed")
    parser.add_argument("--spec", help="with --seed: run this spec (JSON) instead of the seed's")
    parser.add_argument("--cases", type=int, help="run this many cases, seeds from --start")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--out", help="append one JSON line per case to this file")
    parser.add_argument("--shrink", action="store_true",
                        help="with --cases: shrink failures too (slow)")
    parser.add_argument("--no-shrink", action="store_true", help="with --seed: do not shrink")
    parser.add_argument("--budget", type=int, default=40, help="runs the shrinker may make")
    parser.add_argument("--summary", metavar="JSONL",
                        help="print a Markdown summary of a --out file and exit")
    args = parser.parse_args(argv)
    if args.summary:
        print(summarize(args.summary))
        return 0
    if args.seed is not None:
        case = generate_case(args.seed)
        if args.spec:
            case.update(json.loads(args.spec))
        print(_describe(case))
        result = run_case(case)
        print(f"seed {args.seed}: {result['status']} ({result['seconds']:.1f} s)\n{result['detail']}")
        if result["status"] == "fail" and not args.no_shrink:
            found = attribute(case, "fail")
            print("without each known suspect:", json.dumps(found))
            # Start shrinking from the case without the suspects the
            # failure does not need.
            for suspect, status in found.items():
                if suspect != "none" and status == "fail":
                    smaller = without_suspect(case, suspect)
                    if run_case(smaller)["status"] == "fail":
                        case = smaller
            smallest = shrink(case, "fail", budget=args.budget)
            print("smallest failing case:\n" + command_for(smallest))
            print(run_case(smallest)["detail"])
        return 1 if result["status"] == "fail" else 0
    if args.cases is None:
        parser.error("give --seed or --cases")
    counts = {}
    out = open(args.out, "a") if args.out else None
    try:
        for seed in range(args.start, args.start + args.cases):
            case = generate_case(seed)
            result = run_case(case)
            counts[result["status"]] = counts.get(result["status"], 0) + 1
            record = {"seed": seed, **result, "suspects": known_suspects(case),
                      "case": {k: case[k] for k in ("model", "fit", "run")}}
            if result["status"] == "fail" and args.shrink:
                smallest = shrink(case, "fail")
                record["smallest"] = command_for(smallest)
            print(f"seed {seed}: {result['status']} ({result['seconds']:.1f} s) "
                  f"{record['suspects'] if result['status'] != 'pass' else ''} "
                  f"{result['detail'].splitlines()[0] if result['detail'] else ''}", flush=True)
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    print("summary:", json.dumps(counts))
    return 1 if counts.get("fail") else 0


if __name__ == "__main__":
    sys.exit(main())
