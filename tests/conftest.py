"""Test setup: quiet TensorFlow, two logical CPU devices for MirroredStrategy.

The logical devices must be configured before TensorFlow initialises its
runtime, so this runs at import time, before any test module touches TF.
"""

import gc
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# apply_passes checks every graph with Graph.lint() before and after each
# pass (see passes/infra/manager.py): a pass leaving a malformed graph fails there.
os.environ.setdefault("KIP_LINT_GRAPHS", "1")

# The report is rendered as wide as the terminal; tests read its text, so
# they fix the width (pytest-xdist's workers see an 80-column terminal and
# wrapped the words the tests look for). Tests of the width set their own.
os.environ["COLUMNS"] = "160"

# XLA may keep a value in more precision than its dtype where it fuses ops
# (on by default), so under mixed precision with jit_compile a change in the
# graph's structure alone (an outlined function) changes the rounding. The
# tests compare passes with plain Keras exactly: XLA must round as the graph
# says. Read once, when XLA first compiles, so it is set before TF starts.
if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
    ).strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
)


_last_collection = [time.monotonic()]


@pytest.fixture(autouse=True, scope="module")
def _collect_after_each_module():
    """Free each module's reference cycles when it ends.

    Keras's epoch iterators are left in reference cycles, and deleting an
    autotuned tf.data iterator can wait for its tuning thread's sleep, which
    grows to a minute as the iterator ages. Left to the automatic collector,
    hundreds of them were deleted in one later collection (214 s, seen in
    `test_model_state`). Collected here, they die young, a few at a time;
    at most every 20 s (a full collection costs up to a second, and an
    xdist worker may switch modules often).
    """
    yield
    if time.monotonic() - _last_collection[0] > 20:
        gc.collect()
        _last_collection[0] = time.monotonic()


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    np.random.seed(1234)
    yield
    keras.backend.clear_session(free_memory=False)


@pytest.fixture
def mirrored():
    """A MirroredStrategy over the two logical CPU devices, reducing through
    one device rather than collective ops.

    Two MirroredStrategy instances with collective ops in one process hand
    out the same collective instance keys, so a second `fit` under a fresh
    strategy fails with "Shape mismatch in the collective instance 100"
    (plain Keras too, no plugin involved). Collectives are not what these
    tests are about; the multi-worker test uses real collectives.
    """
    return tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
