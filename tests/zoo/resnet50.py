"""Follows `keras.applications.ResNet50` with `weights=None` (no download),
the residual network of He et al. (bottleneck blocks with
BatchNormalization),
used at the minimum input size of 32x32 as the feature extractor of a
subclassed fine-tuning model with a Dense head (`include_top=False,
pooling="avg"`).
"""

import keras

from ._applications import BATCH  # noqa: F401 - the corpus interface
from ._applications import compile_kwargs  # noqa: F401 - the corpus interface
from ._applications import image_data as data  # noqa: F401 - the corpus interface
from ._applications import make

SLOW = True
NO_NORM_LAYERS = True  # BatchNormalization only: not of the LayerNormalization family


def build():
    return make(keras.applications.ResNet50, "resnet50")
