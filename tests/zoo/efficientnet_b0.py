"""Follows `keras.applications.EfficientNetB0` with `weights=None` (no download),
the network of Tan and Le (MBConv blocks with squeeze-and-excitation,
and the application's own Rescaling and Normalization preprocessing),
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
    return make(keras.applications.EfficientNetB0, "efficientnet_b0")
