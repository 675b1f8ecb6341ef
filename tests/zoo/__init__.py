"""The public-architecture corpus: models nobody here designed.

Each module in this package is a small port, written here, of one public
Keras example or library model, and says in its docstring which one. Every
module has the same interface, which `harness.Subject` reads:

- `build()`: a fresh, unbuilt (or, for functional parts, built) model;
- `data(batch)`: an `(x, y)` batch of synthetic data (`y` may be None),
  as `fit` receives it;
- `compile_kwargs()`: fresh keyword arguments for the model's `compile`
  (the model's own `compile` signature where it has one);

and optionally

- `BATCH`: the batch size (default 4);
- `model_input(x, y)`: what the model's `call` takes, when that is not `x`
  (a train step that calls `self([source, target[:, :-1]])`);
- `parts(model, x, y)`: `[(label, model, inputs)]` for a model whose
  forward pass lives in `train_step` (GANs have no `call`): the
  structural checks run on each sub-model the step calls;
- `EXPECT_OPAQUE`: why the model cannot be fully traced, only where it
  genuinely cannot;
- `NO_NORM_LAYERS = True`: the model states it has no layer of the
  LayerNormalization family (the harness checks the statement);
- `SLOW = True`: the checks of this model take more than ~10 s on 2 cores.

`MODELS` lists the corpus in scoreboard order.
"""

MODELS = (
    # keras.io examples: generative
    "vae",
    "dcgan",
    "wgan_gp",
    "pixelcnn",
    "vae_tf_random",
    "vq_vae",
    "ddpm",
    # keras.io examples: vision
    "perceiver",
    "vit",
    "mlp_mixer",
    "fnet",
    "gmlp",
    "swin",
    "cct",
    "pointnet",
    "siamese",
    "distillation",
    "vit_small_ds",
    "shiftvit",
    # keras.io examples: text, audio, structured data, graphs
    "translation_transformer",
    "speech_transformer",
    "recommender",
    "gat",
    "ner_transformer",
    "switch_transformer",
    "grn_vsn",
    # keras-rs examples: recommenders
    "dcn",
    "listwise_ranking",
    # keras_hub backbones (tiny configs from constructors, no presets)
    "bert",
    "gpt2",
    "llama",
    "gemma",
    "t5",
    "bart",
    "gpt_text_generation",
    # keras.applications (weights=None)
    "resnet50",
    "efficientnet_b0",
    "convnext_tiny",
    "mobilenet_v3_small",
)
