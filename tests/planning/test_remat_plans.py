"""Every kind of recompute plan trains as plain Keras does.

A plan chooses per node between keep, recompute inside its layer and
recompute from a checkpoint (`recompute_plan`); the executor runs the notes
(`remat="keep"`, `remat="inside"`, `recompute=True`). Whatever the mix, the
gradients and the Adam weights after 3 steps equal plain Keras's, in graph
mode and under XLA.
"""

import functools
import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_ipu_plugin as kip
from keras_ipu_plugin.passes import Expand
from keras_ipu_plugin.passes import Recompute


class GeluBlock(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = [keras.layers.Dense(16, activation="gelu", name=f"d{i}") for i in range(3)]

    def call(self, x):
        h = x
        for layer in self.dense:
            h = layer(h)
        return x + h


class ResidualGelu(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [GeluBlock(name=f"block_{i}") for i in range(3)]
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(24, 16)).astype("float32"),
            rng.normal(size=(24, 1)).astype("float32"))


def _model():
    keras.utils.set_random_seed(7)
    model = ResidualGelu(name="residual")
    model(_data()[0][:8])
    return model


#: Notes by node path: a kind per plan. "checkpoint" puts `recompute=True`
#: after the node; "keep" / "inside" are `remat` notes.
PLANS = {
    "checkpoints": {"blocks.0.add": "checkpoint", "blocks.1.add": "checkpoint"},
    "inside": {f"blocks.{b}.dense.{i}": "inside" for b in range(3) for i in range(3)},
    "mixed": {
        # block 0 kept, then a segment of block 1 with its Dense layers
        # nested inside it, then block 2's middle layer alone, kept around it.
        "blocks.0.add": "keep",
        "blocks.1.dense.0": "inside", "blocks.1.dense.2": "inside",
        "blocks.1.add": "checkpoint",
        "blocks.2.dense.0": "keep",
        "blocks.2.dense.1": "checkpoint",
    },
    # every Dense keeps its pre-activation and recomputes gelu from it
    # (`activation_remat`), run normally
    "activation": {f"blocks.{b}.dense.{i}": "activation" for b in range(3) for i in range(3)},
    # split Dense layers in every kind of run: a plain segment (block 0), a
    # nested one whose layers also run under their own checkpoint (block 1)
    # and kept (block 2)
    "activation-mixed": {
        **{f"blocks.{b}.dense.{i}": "activation" for b in range(3) for i in range(3)},
        "blocks.0.add": "checkpoint",
        "blocks.1.dense.0": "inside+activation", "blocks.1.dense.1": "inside+activation",
        "blocks.1.add": "checkpoint",
    },
}


def _notes(kind):
    """The annotations of a `PLANS` kind."""
    notes = {}
    for part in kind.split("+"):
        if part == "checkpoint":
            notes["recompute"] = True
        elif part == "activation":
            notes["activation_remat"] = True
        else:
            notes["remat"] = part
    return notes


def _passed(plan):
    converted = kip.convert_to_functional(_model(), _data()[0][:8])
    if plan == "auto":
        return kip.apply_passes(converted, [Expand(), Recompute(auto=True)])
    if plan == "auto-budget":
        # The blocks as converted (no Expand): no plan of whole blocks meets
        # the budget, so the planner expands them and recomputes inside.
        return kip.apply_passes(converted, [Recompute(auto=True, memory_budget=0.4)])
    passed = kip.apply_passes(converted, [Expand()])
    if plan == "exact":
        _annotate_exact_optimum(passed.kip_graph, 0.4)
        return passed
    for path, kind in PLANS[plan].items():
        passed.kip_graph.node(path).annotations.update(_notes(kind))
    return passed


def _annotate_exact_optimum(graph, memory_budget):
    """Write onto `graph` the notes of the exact search's plan under
    `memory_budget` (`exact_plan.least_recompute`: per-node activation
    splits and per-node nesting chosen with the checkpoints)."""
    from keras_ipu_plugin.planning import exact_plan
    from keras_ipu_plugin.planning import graph_planning

    choice = graph_planning.choose_recompute(graph, memory_budget, "recompute")
    args = (graph, choice.order, choice.profiles, choice.batch)
    plain = graph_planning.recompute_costs(*args, split=False)
    split = graph_planning.recompute_costs(*args, split="every")
    overhead = graph_planning.step_overhead(graph, choice.batch)
    found = exact_plan.least_recompute(plain, split, choice.budget - overhead)
    # a plan worth checking: segments, some nested, some layers split
    assert found.checkpoints and found.inside and found.splits, found
    for index in found.checkpoints:
        choice.order[index].annotations["recompute"] = True
    for index in found.keeps:
        choice.order[index].annotations["remat"] = "keep"
    for index in found.inside:
        choice.order[index].annotations["remat"] = "inside"
    for index in found.splits:
        choice.order[index].annotations["activation_remat"] = True


def _name(model, path):
    """The Keras name the notes of the node at `path` are kept under (an
    operation node, such as a residual add, is named by its path)."""
    return model.kip_layer_paths.get(path, path)


def _segments(model):
    from keras_ipu_plugin.runtime.backends import get_backend
    from keras_ipu_plugin.runtime.effects import make_plan

    return make_plan(model, get_backend())


def test_the_notes_make_the_segments_the_plan_means():
    model = _passed("mixed")
    runs = [([n.name for n in s.nodes], s.recompute) for s in _segments(model)]
    name = {path: path for path in PLANS["mixed"]}
    # the kept add ends block 0's run, which runs normally
    kept = next(i for i, (names, _) in enumerate(runs) if names == [name["blocks.0.add"]])
    assert not runs[kept][1] and not runs[kept - 1][1]
    # block 1 is one recomputed segment, its checkpoint at its add
    segment = next(r for r in runs if name["blocks.1.add"] in r[0])
    assert segment[1] and segment[0][-1] == name["blocks.1.add"] and len(segment[0]) == 4
    # block 2's middle layer is recomputed alone, between kept layers
    alone = next(r for r in runs if name["blocks.2.dense.1"] in r[0])
    assert alone == ([name["blocks.2.dense.1"]], True)


def test_an_inside_note_runs_its_layer_under_its_own_checkpoint(monkeypatch):
    from keras_ipu_plugin.runtime import backends

    wrapped = []
    original = backends.PortableBackend.checkpoint_segment

    def counting(self, fn, anchored=None):
        wrapped.append(fn)
        return original(self, fn, anchored)

    monkeypatch.setattr(backends.PortableBackend, "checkpoint_segment", counting)
    model = _passed("inside")
    model(_data()[0][:8], training=True)
    assert len(wrapped) == 9  # each Dense alone, none merged


#: Three Adam steps at 1e-2 move a weight by up to 3e-2, and a wrong
#: gradient by about that much; a recomputed gelu rounds an ulp apart
#: (fused otherwise), which Adam's normalisation magnifies for a gradient
#: near zero (one weight of 256 ended 3e-5 apart; with the blocks expanded by
#: a budgeted plan, whose gradients agree to 1e-5, one of 256 ended 1.3e-4
#: apart, a tenth of a wrong gradient's distance).
ADAM_ATOL = 2e-4


def _loss(model, x, y):
    return tf.reduce_mean(tf.square(model(x, training=True) - y))


def _gradients(model, jit_compile):
    x, y = _data()

    @tf.function(jit_compile=jit_compile)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(model, x, y)
        return tape.gradient(loss, model.trainable_variables)

    return [g.numpy() for g in step(tf.constant(x[:8]), tf.constant(y[:8]))]


def _adam_weights(model, jit_compile):
    x, y = _data()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)  # 3 steps
    return [v.numpy() for v in model.trainable_variables]


@functools.cache
def _plain_keras(jit_compile):
    """Plain Keras's gradients and weights after 3 Adam steps: the reference
    of every plan, computed once per mode (`_model()` seeds itself, so the
    values do not depend on what ran before)."""
    return _gradients(_model(), jit_compile), _adam_weights(_model(), jit_compile)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
@pytest.mark.parametrize("plan", [*PLANS, "auto", "auto-budget", "exact"])
def test_gradients_and_adam_weights_equal_plain_keras(plan, jit_compile):
    expected, want = _plain_keras(jit_compile)
    passed = _passed(plan)
    if plan not in ("inside", "activation"):  # (these notes run within one plain segment)
        assert len(_segments(passed)) > 1
    for got, want_gradient in zip(_gradients(passed, jit_compile), expected):
        np.testing.assert_allclose(got, want_gradient, rtol=1e-5, atol=1e-6)
    got = _adam_weights(_passed(plan), jit_compile)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=ADAM_ATOL)


def test_an_activation_note_keeps_the_pre_activation_and_recomputes_gelu(monkeypatch):
    from keras_ipu_plugin.runtime import backends

    wrapped = []
    original = backends.PortableBackend.checkpoint_segment

    def counting(self, fn, anchored=None):
        wrapped.append(anchored)
        return original(self, fn, anchored)

    monkeypatch.setattr(backends.PortableBackend, "checkpoint_segment", counting)
    model = _passed("activation")
    x = _data()[0][:8]
    np.testing.assert_array_equal(model(x, training=True).numpy(),
                                  _model()(x, training=True).numpy())
    assert wrapped == [1] * 9  # each Dense's activation alone, from its one input


def test_a_layer_that_is_not_a_plain_dense_runs_as_it_is_under_the_note():
    from keras_ipu_plugin.runtime.effects import splittable

    class Scaled(keras.layers.Dense):  # a subclass may change `call`
        def call(self, x):
            return 2 * super().call(x)

    layers = [Scaled(4, activation="gelu"), keras.layers.Dense(4),
              keras.layers.Dense(4, activation="gelu", dtype="mixed_float16"),
              keras.layers.Dense(4, activation="gelu", activity_regularizer="l2")]
    for layer in layers:
        layer.build((None, 3))
        assert not splittable(layer), layer
    plain = keras.layers.Dense(4, activation="gelu")
    assert not splittable(plain)  # not built
    plain.build((None, 3))
    assert splittable(plain)


def test_the_auto_plan_splits_a_gelu_dense_and_says_so():
    passed = _passed("auto")
    figures = next(p for p in passed.kip_report.plans
                   if p.title.startswith("Recompute plan")).figures
    split = figures["activation_remat"]
    # (a small graph is planned by the exact search, which splits a layer
    # only where that helps the plan: some of the 9)
    assert 1 <= len(split) <= 9
    for name in split:
        assert passed.kip_annotations[_name(passed, name)]["activation_remat"] is True
    # the baseline is without recomputation of any kind: splitting alone
    # is estimated below it
    assert figures["peak"] < figures["baseline_peak"]


def test_the_auto_plan_mixes_kinds_and_its_report_names_them():
    passed = _passed("auto")
    figures = next(p for p in passed.kip_report.plans
                   if p.title.startswith("Recompute plan")).figures
    kinds = set(figures["kinds"].values())
    assert "checkpoint" in kinds or "inside" in kinds
    assert figures["peak"] < figures["baseline_peak"]
    for path in figures["keeps"]:
        assert passed.kip_annotations[_name(passed, path)]["remat"] == "keep"


def _recompute_figures(model):
    return next(p for p in model.kip_report.plans
                if p.title.startswith("Recompute plan")).figures


def test_a_budget_whole_blocks_cannot_meet_is_met_inside_them():
    """`Recompute(auto=True, memory_budget=...)` on a model whose blocks are
    still whole (no `Expand()`) reaches what recomputing each layer inside
    its block's recomputation reaches (`keras.RematScope("larger_than")`):
    the planner expands the blocks and says so, rather than refusing."""
    passed = _passed("auto-budget")
    figures = _recompute_figures(passed)
    assert figures["peak"] <= figures["budget"]
    assert "expanded as Expand() does: no plan of the whole layers meets" in figures[
        "planned_on"]
    paths = {node.name for node in passed.kip_graph.nodes}
    assert {f"blocks.{b}.dense.{i}" for b in range(3) for i in range(3)} <= paths
    # what the plan recomputes is written on the expanded layers
    assert any(passed.kip_annotations.get(_name(passed, name), {}).get("recompute")
               for name in figures["checkpoints"])


def test_a_budget_the_whole_blocks_meet_cheaper_keeps_them_whole():
    """Without need (a budget the whole blocks meet at least as cheaply) the
    blocks stay as they were converted."""
    converted = kip.convert_to_functional(_model(), _data()[0][:8])
    passed = kip.apply_passes(converted, [Recompute(auto=True, memory_budget=1.0)])
    assert "blocks.0" in {node.name for node in passed.kip_graph.nodes}
    assert "planned_on" not in _recompute_figures(passed)


# -- Keras masks across a recomputed segment's boundary ----------------------------
class ZeroPadded(keras.layers.Layer):
    """Zeroes the positions its input's Keras mask marks as padding: called
    without `mask=`, Keras passes it the mask its input carries."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def call(self, x, mask=None):
        if mask is None:
            return x
        return x * keras.ops.cast(mask[..., None], x.dtype)


class MaskedBlock(keras.layers.Layer):
    """Passes its mask on only through the tensor (as MultiHeadAttention
    reads its query's and value's masks in the translation transformer's
    encoder)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.padded = ZeroPadded(name="padded")
        self.dense = keras.layers.Dense(8, activation="tanh", name="dense")
        self.supports_masking = True

    def call(self, x):
        return x + self.dense(self.padded(x))


class MaskedModel(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(12, 8, mask_zero=True, name="embedding")
        self.first = MaskedBlock(name="first")
        self.second = MaskedBlock(name="second")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, ids):
        return self.head(self.second(self.first(self.embedding(ids))))


@pytest.mark.parametrize("targets", [["first"], ["embedding"], ["embedding", "first"]])
def test_a_recomputed_segment_keeps_the_keras_masks_it_takes_and_gives(targets):
    """The tensors crossing a segment's boundary are new ones: the mask the
    input carries is handed in, and the outputs' masks handed out (lost,
    the zoo's translation transformer computed other outputs)."""
    ids = np.array([[3, 4, 0, 0], [5, 0, 0, 0], [1, 2, 3, 4]] * 2)
    keras.utils.set_random_seed(3)
    model = MaskedModel(name="masked")
    expected = np.asarray(model(ids))
    converted = kip.convert_to_functional(model, ids)
    passed = kip.apply_passes(converted, [Recompute(targets)], verify=False)
    np.testing.assert_allclose(np.asarray(passed(ids)), expected, atol=1e-6)

    def gradients(subject):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(subject(ids) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    for got, want in zip(gradients(tf.function(passed)), gradients(model)):
        np.testing.assert_allclose(np.asarray(tf.convert_to_tensor(got)),
                                   np.asarray(tf.convert_to_tensor(want)), atol=1e-5)


def test_a_small_graph_is_planned_by_the_exact_search_and_the_report_says_so():
    """A graph of a few dozen nodes gets the optimum of the cost model
    (per-node activation splits and nesting), which trains as plain Keras
    (the "auto" plans above), and its report names the planner."""
    from keras_ipu_plugin.planning import graph_planning

    passed = _passed("auto")
    figures = next(p for p in passed.kip_report.plans
                   if p.title.startswith("Recompute plan")).figures
    assert len(passed.kip_graph.nodes) <= graph_planning.EXACT_NODES
    assert figures["planner"].startswith("exact search"), figures["planner"]

