"""Follows the Keras example "PixelCNN" (ADMoreau,
https://keras.io/examples/generative/pixelcnn/): a `PixelConvLayer` that masks
its Conv2D's kernel on every call (`self.conv.kernel.assign(self.conv.kernel
* self.mask)`, mask type "A" or "B", built from the kernel's shape), then
calls the conv; a `ResidualBlock` of a 1x1 conv, a masked 3x3 conv and a 1x1
conv added to its input with `keras.layers.add`; and the example's
functional model: a type-A masked 7x7 conv, residual blocks, two type-B
masked 1x1 convs and a sigmoid 1x1 conv, trained with Adam on binary
cross-entropy to predict the image itself. Tiny sizes: 8x8 binarized
images, 8 filters, 2 residual blocks (the example: 28x28, 128, 5).

The kernel writes are why this model is in the corpus: a graph that lost
them passed every first-batch check (the kernels were already masked) and
trained differently from plain Keras.
"""

import keras
import numpy as np
from keras import layers
from keras import ops

IMAGE, FILTERS, BLOCKS = 8, 8, 2
NO_NORM_LAYERS = True


class PixelConvLayer(layers.Layer):
    def __init__(self, mask_type, **kwargs):
        super().__init__()
        self.mask_type = mask_type
        self.conv = layers.Conv2D(**kwargs)

    def build(self, input_shape):
        # Build the conv layer to initialize kernel variables
        self.conv.build(input_shape)
        # Use the initialized kernel to create the mask
        kernel_shape = ops.shape(self.conv.kernel)
        self.mask = np.zeros(shape=kernel_shape)
        self.mask[: kernel_shape[0] // 2, ...] = 1.0
        self.mask[kernel_shape[0] // 2, : kernel_shape[1] // 2, ...] = 1.0
        if self.mask_type == "B":
            self.mask[kernel_shape[0] // 2, kernel_shape[1] // 2, ...] = 1.0

    def call(self, inputs):
        self.conv.kernel.assign(self.conv.kernel * self.mask)
        return self.conv(inputs)


class ResidualBlock(keras.layers.Layer):
    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.conv1 = keras.layers.Conv2D(filters=filters, kernel_size=1, activation="relu")
        self.pixel_conv = PixelConvLayer(
            mask_type="B",
            filters=filters // 2,
            kernel_size=3,
            activation="relu",
            padding="same",
        )
        self.conv2 = keras.layers.Conv2D(filters=filters, kernel_size=1, activation="relu")

    def call(self, inputs):
        x = self.conv1(inputs)
        x = self.pixel_conv(x)
        x = self.conv2(x)
        return keras.layers.add([inputs, x])


def build():
    inputs = keras.Input(shape=(IMAGE, IMAGE, 1))
    x = PixelConvLayer(mask_type="A", filters=FILTERS, kernel_size=7, activation="relu",
                       padding="same")(inputs)
    for _ in range(BLOCKS):
        x = ResidualBlock(filters=FILTERS)(x)
    for _ in range(2):
        x = PixelConvLayer(mask_type="B", filters=FILTERS, kernel_size=1, strides=1,
                           activation="relu", padding="valid")(x)
    out = keras.layers.Conv2D(filters=1, kernel_size=1, strides=1, activation="sigmoid",
                              padding="valid")(x)
    return keras.Model(inputs, out, name="pixel_cnn")


def data(batch):
    # binarized images, as the example quantises MNIST: predict the image
    images = (np.random.default_rng(0).random((batch, IMAGE, IMAGE, 1)) > 0.5)
    images = images.astype("float32")
    return images, images


def compile_kwargs():
    return {"optimizer": keras.optimizers.Adam(learning_rate=0.0005),
            "loss": "binary_crossentropy"}
