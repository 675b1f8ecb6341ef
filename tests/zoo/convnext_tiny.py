"""Follows `keras.applications.ConvNeXtTiny` with `weights=None` (no download),
the network of Liu et al. (depthwise convolutions, LayerNormalization,
and the application's own `LayerScale` layer, a class that
keras.layers does not export),
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


def build():
    return make(keras.applications.ConvNeXtTiny, "convnext_tiny")
