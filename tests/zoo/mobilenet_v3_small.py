"""Follows `keras.applications.MobileNetV3Small` with `weights=None` (no download),
the network of Howard et al. (inverted residuals, hard-swish,
squeeze-and-excitation, and its own Rescaling preprocessing),
used at the minimum input size of 32x32 as the feature extractor of a
subclassed fine-tuning model with a Dense head (`include_top=False,
pooling="avg"`).
"""

import keras

from ._applications import compile_kwargs  # noqa: F401 - the corpus interface
from ._applications import image_data as data  # noqa: F401 - the corpus interface
from ._applications import make

SLOW = True
# Batches of 8, not 2: at 32x32 its last feature maps are 1x1, and
# BatchNormalization over 2 values makes training chaotic (plain Keras run
# eagerly and in a graph differ by 6% in loss after 3 steps).
BATCH = 8
NO_NORM_LAYERS = True  # BatchNormalization only: not of the LayerNormalization family


def build():
    return make(keras.applications.MobileNetV3Small, "mobilenet_v3_small")
