"""Follows the Keras example "Knowledge Distillation" (Kenneth Borup,
keras.io/examples/vision/knowledge_distillation/): a `Distiller` model over
a (fixed) teacher and a student, with its own
`compile(optimizer=, metrics=, student_loss_fn=, distillation_loss_fn=,
alpha=, temperature=)`, a `compute_loss` override mixing the student loss
with the KL divergence between the softened teacher and student
predictions, and `call` running the student. The `train_step` is the one
of the example's earlier version, in Keras 3 form: forward through
`self(x)`, the loss from the overridden `compute_loss`, gradients for the
student's variables only, compiled metrics updated. Tiny sizes: 8x8 grey
images, 4 classes.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import layers
from keras import ops

IMAGE, CLASSES = 8, 4
NO_NORM_LAYERS = True


class Distiller(keras.Model):
    def __init__(self, student, teacher, **kwargs):
        super().__init__(**kwargs)
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn,
                alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1),
        ) * (self.temperature ** 2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        trainable_vars = self.student.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        results = self.compute_metrics(x, y, y_pred)
        results["loss"] = loss
        return results


def make_net(name, width):
    return keras.Sequential([
        keras.Input(shape=(IMAGE, IMAGE, 1)),
        layers.Conv2D(width, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(negative_slope=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(width, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(CLASSES),
    ], name=name)


def build():
    teacher = make_net("teacher", 16)
    teacher.trainable = False
    return Distiller(student=make_net("student", 4), teacher=teacher, name="distiller")


def data(batch):
    rng = np.random.RandomState(0)
    return rng.rand(batch, IMAGE, IMAGE, 1).astype("float32"), rng.randint(0, CLASSES, size=(batch,))


def compile_kwargs():
    return {
        "optimizer": keras.optimizers.Adam(),
        "metrics": [keras.metrics.SparseCategoricalAccuracy()],
        "student_loss_fn": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "distillation_loss_fn": keras.losses.KLDivergence(),
        "alpha": 0.1,
        "temperature": 10,
    }
