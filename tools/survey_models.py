"""Survey: public Keras architectures NOT in tests/zoo, each converted,
expanded and compared at another batch size.

For each model: build it from a tiny constructor config (no presets, no
network), call it on a batch of 2, `kip.convert_to_functional` (verified),
list the opaque nodes, `kip.apply_passes(converted, [Expand("all")])`
(verified), list the custom layers left, compare the passed model with
the original on a batch of 3 (outputs and gradients), and `Replace` every
layer of the LayerNormalization family (as tests/zoo's check does). The
last lines count the models that expand to built-in layers only and those
whose norm layers `Replace` reaches, every one.

Each model runs in its own process under a timeout, so one hang or crash
does not block the rest.

Usage:
    PYTHONPATH=$PWD python3 tools/survey_models.py [NAME ...] [--timeout 300] [--json out.jsonl]
    PYTHONPATH=$PWD python3 tools/survey_models.py --one NAME     # one model, in this process
"""

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KIP_LINT_GRAPHS", "1")

VOCAB, LENGTH, IMAGE = 40, 8, 32


# -- models -----------------------------------------------------------------------------
def _hub(cls_name, **config):
    def build():
        import keras_hub
        return getattr(keras_hub.models, cls_name)(**config)
    return build


TEXT = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=8, intermediate_dim=16)
BACKBONES = {
    "DistilBert": _hub("DistilBertBackbone", num_heads=2, max_sequence_length=16, **TEXT),
    "Roberta": _hub("RobertaBackbone", num_heads=2, max_sequence_length=16, **TEXT),
    "Albert": _hub("AlbertBackbone", num_heads=2, embedding_dim=4, max_sequence_length=16, **TEXT),
    "Electra": _hub("ElectraBackbone", vocab_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=8,
                    embedding_dim=8, intermediate_dim=16, max_sequence_length=16),
    "DebertaV3": _hub("DebertaV3Backbone", num_heads=2, max_sequence_length=16, bucket_size=4, **TEXT),
    "Mistral": _hub("MistralBackbone", num_query_heads=2, num_key_value_heads=1, sliding_window=4, **TEXT),
    "Phi3": _hub("Phi3Backbone", num_query_heads=2, num_key_value_heads=1, max_sequence_length=16,
                 pretraining_sequence_length=16, **TEXT),
    "Falcon": _hub("FalconBackbone", num_attention_heads=2, **TEXT),
    "OPT": _hub("OPTBackbone", num_heads=2, max_sequence_length=16, **TEXT),
    "Qwen2": _hub("Qwen2Backbone", num_query_heads=2, num_key_value_heads=1, **TEXT),
    "GPTNeoX": _hub("GPTNeoXBackbone", num_heads=2, max_sequence_length=16, rotary_percentage=0.5, **TEXT),
    "Bloom": _hub("BloomBackbone", num_heads=2, **TEXT),
    "XLNet": _hub("XLNetBackbone", num_heads=2, **TEXT),
    "Whisper": _hub("WhisperBackbone", num_heads=2, num_mels=8, max_encoder_sequence_length=16,
                    max_decoder_sequence_length=16, **TEXT),
    "ViT": _hub("ViTBackbone", image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2,
                hidden_dim=8, mlp_dim=16),
    "DeiT": _hub("DeiTBackbone", image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2,
                 hidden_dim=8, intermediate_dim=16),
    "SwinTransformer": _hub("SwinTransformerBackbone", image_shape=(32, 32, 3), embed_dim=8,
                            depths=[2, 2], num_heads=[2, 2], window_size=4, patch_size=4),
    "ResNet": _hub("ResNetBackbone", input_conv_filters=[64], input_conv_kernel_sizes=[3],
                   stackwise_num_filters=[64, 16], stackwise_num_blocks=[1, 1],
                   stackwise_num_strides=[1, 2], block_type="basic_block",
                   image_shape=(IMAGE, IMAGE, 3)),
    "CSPNet": _hub("CSPNetBackbone", stem_filters=8, stem_kernel_size=3, stem_strides=2,
                   stackwise_depth=[1, 1], stackwise_strides=[1, 2], stackwise_num_filters=[16, 32],
                   block_type="bottleneck_block", stage_type="cs3", bottle_ratio=[0.5],
                   block_ratio=[0.5], image_shape=(IMAGE, IMAGE, 3)),
    "DenseNet": _hub("DenseNetBackbone", stackwise_num_repeats=[1, 1], growth_rate=4,
                     image_shape=(IMAGE, IMAGE, 3)),
    "MiT": _hub("MiTBackbone", layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2],
                layerwise_sr_ratios=[2, 1], max_drop_path_rate=0.1, layerwise_patch_sizes=[3, 3],
                layerwise_strides=[2, 2], hidden_dims=[8, 16], image_shape=(IMAGE, IMAGE, 3)),
    "VGG": _hub("VGGBackbone", stackwise_num_repeats=[1, 1], stackwise_num_filters=[4, 8],
                image_shape=(IMAGE, IMAGE, 3)),
    "RoformerV2": _hub("RoformerV2Backbone", num_heads=2, head_size=4, **TEXT),
    "ESM": _hub("ESMBackbone", num_heads=2, max_sequence_length=16, **TEXT),
    # drop_path_rate 0: keras_hub's `DINOV2DropPath` builds its noise shape from the symbolic
    # build's batch (None), so with a rate above 0 plain Keras fails in training mode
    # (`random.uniform((None, 1, 1))`) and no training mode can be verified
    "DINOV2": _hub("DINOV2Backbone", patch_size=4, num_layers=2, hidden_dim=8, num_heads=2,
                   intermediate_dim=16, image_shape=(16, 16, 3),
                   position_embedding_shape=(16, 16, 3), drop_path_rate=0.0),
    # expert routing computes with the batch size (`ops.shape(x)[0] // k`)
    "Mixtral": _hub("MixtralBackbone", num_query_heads=2, num_key_value_heads=1, num_experts=2,
                    top_k=1, sliding_window=4, **TEXT),
    "RWKV7": _hub("RWKV7Backbone", hidden_size=8, head_size=4, num_layers=2,
                  vocabulary_size=VOCAB, intermediate_dim=16, gate_lora=4, mv_lora=4,
                  aaa_lora=4, decay_lora=4),
}


def _application(name, image=IMAGE, **kwargs):
    def build():
        import keras
        return getattr(keras.applications, name)(
            include_top=False, weights=None, input_shape=(image, image, 3), pooling="avg", **kwargs)
    return build


APPLICATIONS = {
    "app.DenseNet121": _application("DenseNet121"),
    "app.Xception": _application("Xception", image=71),
    "app.MobileNetV2": _application("MobileNetV2", alpha=0.35),
    "app.EfficientNetV2B0": _application("EfficientNetV2B0"),
    "app.NASNetMobile": _application("NASNetMobile"),
    "app.MobileNet": _application("MobileNet", alpha=0.25),
}


def _wrap(build_backbone):
    """A subclassed model over the backbone, as users fine-tune one."""
    import keras

    class Wrapped(keras.Model):
        def __init__(self, backbone, **kwargs):
            super().__init__(**kwargs)
            self.backbone = backbone
            self.head = keras.layers.Dense(3, name="head")

        def call(self, inputs, training=None):
            outputs = self.backbone(inputs, training=training)
            return keras.tree.map_structure(self.head, outputs)

    return Wrapped(build_backbone(), name="wrapped")


def _data_for(backbone, batch):
    """Inputs matching a functional backbone's `inputs`."""
    import numpy as np
    rng = np.random.RandomState(batch)
    inputs = backbone.input if isinstance(backbone.input, dict) else None
    specs = backbone.inputs
    names = [getattr(t, "name", "") for t in specs]
    values = []
    for tensor in specs:
        name = tensor.name
        shape = [batch] + [LENGTH if d is None else d for d in tensor.shape[1:]]
        if "int" in str(tensor.dtype) or "bool" in str(tensor.dtype):
            if "mask" in name:
                value = np.ones(shape, "int32")
                value[1:, -2:] = 0
            elif "segment" in name:
                value = np.zeros(shape, "int32")
            else:
                value = rng.randint(1, VOCAB, size=shape).astype("int32")
        else:
            value = rng.rand(*shape).astype("float32")
        values.append(value)
    if inputs is not None:
        return {key: values[[t is v for t in specs].index(True)] for key, v in inputs.items()}
    return values[0] if len(values) == 1 else values


# -- hand-written keras.io-style subclassed models ------------------------------------------
def custom_models():
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers, ops

    class TFStyleBlock(layers.Layer):
        """Keras-2 style: tf.* functions inside call."""

        def __init__(self, units, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(units)

        def call(self, x):
            h = self.dense(x)
            h = tf.nn.relu(h) + tf.reduce_mean(h, axis=-1, keepdims=True)
            h = tf.concat([h, tf.math.sqrt(tf.square(h) + 1.0)], axis=-1)
            b = tf.shape(h)[0]
            return tf.reshape(h, [b, -1])

    class TFStyleModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.block = TFStyleBlock(8)
            self.out = layers.Dense(2)

        def call(self, x):
            return self.out(self.block(x))

    class DownBlock(layers.Layer):
        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.conv = layers.Conv2D(filters, 3, padding="same", activation="relu")
            self.norm = layers.BatchNormalization()
            self.pool = layers.MaxPooling2D()

        def call(self, x, training=None):
            skip = self.norm(self.conv(x), training=training)
            return self.pool(skip), skip

    class UpBlock(layers.Layer):
        def __init__(self, filters, **kwargs):
            super().__init__(**kwargs)
            self.up = layers.Conv2DTranspose(filters, 2, strides=2, padding="same")
            self.conv = layers.Conv2D(filters, 3, padding="same", activation="relu")

        def call(self, x, skip):
            x = self.up(x)
            return self.conv(layers.concatenate([x, skip]))

    class UNet(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.downs = [DownBlock(4), DownBlock(8)]
            self.middle = layers.Conv2D(16, 3, padding="same", activation="relu")
            self.ups = [UpBlock(8), UpBlock(4)]
            self.out = layers.Conv2D(2, 1)

        def call(self, x, training=None):
            skips = []
            for down in self.downs:
                x, skip = down(x, training=training)
                skips.append(skip)
            x = self.middle(x)
            for up, skip in zip(self.ups, reversed(skips)):
                x = up(x, skip)
            return self.out(x)

    class NoisyDropout(layers.Layer):
        """A custom layer with Python `if training:`."""

        def __init__(self, rate, **kwargs):
            super().__init__(**kwargs)
            self.rate = rate
            self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

        def call(self, x, training=None):
            if training:
                x = x * (1.0 - self.rate)
            return x * self.scale

    class TrainingFlagModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = layers.Dense(8)
            self.noisy = NoisyDropout(0.1)
            self.out = layers.Dense(2)

        def call(self, x, training=None):
            return self.out(self.noisy(self.dense(x), training=training))

    class Seq2SeqAttention(keras.Model):
        """An LSTM encoder-decoder with Luong-style attention (keras.io style)."""

        def __init__(self, vocab=VOCAB, units=8, **kwargs):
            super().__init__(**kwargs)
            self.enc_embed = layers.Embedding(vocab, 8, mask_zero=True)
            self.encoder = layers.LSTM(units, return_sequences=True, return_state=True)
            self.dec_embed = layers.Embedding(vocab, 8, mask_zero=True)
            self.decoder = layers.LSTM(units, return_sequences=True)
            self.attention = layers.Attention()
            self.out = layers.Dense(vocab)

        def call(self, inputs, training=None):
            source, target = inputs
            enc, h, c = self.encoder(self.enc_embed(source))
            dec = self.decoder(self.dec_embed(target), initial_state=[h, c])
            context = self.attention([dec, enc])
            return self.out(ops.concatenate([dec, context], axis=-1))

    class PatchEncoder(layers.Layer):
        """keras.io 'Image classification with Vision Transformer' style:
        tf.image.extract_patches + position embedding with tf.range."""

        def __init__(self, num_patches, dim, **kwargs):
            super().__init__(**kwargs)
            self.num_patches = num_patches
            self.projection = layers.Dense(dim)
            self.position_embedding = layers.Embedding(num_patches, dim)

        def call(self, images):
            patches = tf.image.extract_patches(images, sizes=[1, 4, 4, 1], strides=[1, 4, 4, 1],
                                               rates=[1, 1, 1, 1], padding="VALID")
            batch = tf.shape(patches)[0]
            patches = tf.reshape(patches, [batch, -1, patches.shape[-1]])
            positions = tf.range(start=0, limit=self.num_patches, delta=1)
            return self.projection(patches) + self.position_embedding(positions)

    class PatchModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.encoder = PatchEncoder(16, 8)
            self.pool = layers.GlobalAveragePooling1D()
            self.out = layers.Dense(2)

        def call(self, x):
            return self.out(self.pool(self.encoder(x)))

    def seq2seq_data(batch):
        rng = np.random.RandomState(batch)
        src = rng.randint(1, VOCAB, size=(batch, LENGTH)).astype("int32")
        tgt = rng.randint(1, VOCAB, size=(batch, LENGTH)).astype("int32")
        src[1:, -2:] = 0
        return [src, tgt]

    images = lambda size, ch=3: (lambda batch: np.random.RandomState(batch).rand(batch, size, size, ch).astype("float32"))
    return {
        "ex.TFStyleLayer": (TFStyleModel, lambda b: np.random.RandomState(b).rand(b, 6).astype("float32")),
        "ex.UNet": (UNet, images(16)),
        "ex.TrainingFlag": (TrainingFlagModel, lambda b: np.random.RandomState(b).rand(b, 6).astype("float32")),
        "ex.Seq2SeqAttention": (Seq2SeqAttention, seq2seq_data),
        "ex.PatchEncoder": (PatchModel, images(16)),
    }


CUSTOM_NAMES = ["ex.TFStyleLayer", "ex.UNet", "ex.TrainingFlag", "ex.Seq2SeqAttention", "ex.PatchEncoder"]
ALL = list(BACKBONES) + list(APPLICATIONS) + CUSTOM_NAMES


# -- one model --------------------------------------------------------------------------
def _model_and_data(name):
    import keras
    keras.utils.set_random_seed(1234)
    if name in BACKBONES:
        model = _wrap(BACKBONES[name])
        return model, (lambda b: _data_for(model.backbone, b))
    if name in APPLICATIONS:
        model = _wrap(APPLICATIONS[name])
        import numpy as np
        size = model.backbone.input_shape[1]
        return model, (lambda b: np.random.RandomState(b).rand(b, size, size, 3).astype("float32") * 2 - 1)
    cls, data = custom_models()[name]
    return cls(name=name.split(".")[1].lower()), data


def survey_one(name):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import keras
    import keras_ipu_plugin as kip
    from zoo import harness

    result = {"model": name, "stage": "build"}
    start = time.perf_counter()
    try:
        model, data = _model_and_data(name)
        x, x3 = data(2), data(3)
        model(x)
        result["stage"] = "convert"
        converted = kip.convert_to_functional(model, x)
        result["opaque"] = [f"{n}: {r}" for n, r in harness.opaque_nodes(converted)]
        result["stage"] = "expand"
        passed = kip.apply_passes(converted, [kip.passes.Expand("all")])
        result["left"] = [f"{n} ({c}): {r}" for n, c, r in harness.custom_layers_left(passed)]
        result["stage"] = "compare"
        difference = harness.compare_models(model, passed, keras.tree.map_structure(
            __import__("tensorflow").convert_to_tensor, x3), gradients=True)
        result["difference"] = difference
        result["stage"] = "replace"
        reach = harness.replace_every_norm(model, converted)
        if reach is not None:
            norms, _, new_layers, still, _ = reach
            result["norms"], result["replaced"] = len(norms), len(new_layers)
            result["norms_left"] = still
        result["stage"] = "done"
        result["nodes"] = len(passed.kip_graph.nodes)
    except Exception as error:  # noqa: BLE001 - the survey goes on
        result["error"] = harness.describe_error(error)[:600]
        result["trace"] = traceback.format_exc()[-3000:]
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def outcome(result):
    if "error" in result:
        return f"ERROR at {result['stage']}: {result['error']}"
    bits = []
    if result.get("difference"):
        bits.append(f"DIFFERS at batch 3: {result['difference']}")
    if result.get("opaque"):
        bits.append(f"{len(result['opaque'])} opaque")
    unexplained = [entry for entry in result.get("left", []) if entry.rstrip().endswith(":")]
    if result.get("left"):
        bits.append(f"{len(result['left'])} custom left ({len(unexplained)} without reason)")
    if result.get("norms") and not replaced_every_norm(result):
        bits.append(f"Replace reached {result['replaced']}/{result['norms']} norms")
    return "; ".join(bits) or f"ok ({result.get('nodes')} nodes)"


def expanded_to_built_ins(result):
    """Whether `Expand("all")` left no custom layer and no opaque node."""
    return result.get("stage") == "done" and not result.get("left") and not result.get("opaque")


def replaced_every_norm(result):
    """Whether `Replace` reached every layer of the LayerNormalization
    family (None for a model without one)."""
    if not result.get("norms"):
        return None
    return result["replaced"] == result["norms"] and not result.get("norms_left")


def scoreboard(results):
    """The survey's last lines: how many models expand to built-in layers
    only, and how many of those with norm layers Replace reaches fully."""
    expanded = sum(bool(expanded_to_built_ins(r)) for r in results)
    with_norms = [r for r in results if r.get("norms")]
    replaced = sum(bool(replaced_every_norm(r)) for r in with_norms)
    return (f"Expand('all') to built-in layers only: {expanded} of {len(results)}\n"
            f"Replace reaches every norm layer: {replaced} of {len(with_norms)} "
            "(the models holding one)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*")
    parser.add_argument("--one")
    parser.add_argument("--timeout", type=int, default=400)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.one:
        print("SURVEY-RESULT " + json.dumps(survey_one(args.one)))
        return
    names = args.names or ALL
    out = open(args.json, "a") if args.json else None
    results = []
    for name in names:
        try:
            run = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                                 text=True, timeout=args.timeout)
            lines = [l for l in run.stdout.splitlines() if l.startswith("SURVEY-RESULT ")]
            result = json.loads(lines[-1][14:]) if lines else {
                "model": name, "stage": "process", "error": f"exit {run.returncode}: {run.stderr[-400:]}"}
        except subprocess.TimeoutExpired:
            result = {"model": name, "stage": "timeout", "error": f"over {args.timeout} s"}
        print(f"{name:22s} {outcome(result)}", flush=True)
        results.append(result)
        if out:
            out.write(json.dumps(result) + "\n")
            out.flush()
    print(scoreboard(results))


if __name__ == "__main__":
    main()
