"""`kip.plot_model` / `kip.model_to_dot`: a converted model drawn as its
summary names it, by node path (not Keras's counter names), a variable read
not drawn as fed by the input, a `PluginModel` drawn as its converted graph,
and an install hint where pydot or graphviz is missing.

The drawings are checked on the dot graph, which needs pydot alone (a test
dependency); only writing an image needs graphviz's `dot` program."""

import re
import shutil
import sys

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.errors import PassError


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
        self.dense = keras.layers.Dense(8)

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(8,), initializer="ones")

    def call(self, x):
        return self.dense(self.att(x, x)) * self.scale


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.blocks = [Block(), Block()]
        self.mlp = keras.Sequential([keras.layers.Dense(8), keras.layers.Dense(8)])
        self.head = keras.layers.Dense(1)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.mlp(x))


X = np.random.default_rng(0).random((2, 5, 8)).astype("float32")


def _passed():
    converted = kip.convert_to_functional(Net(), X)
    return kip.apply_passes(converted, [kip.passes.Expand("all")])


def _titles(dot):
    """`{dot node name: the bold title of its box}`."""
    return {node.get_name(): re.search(r"<b>(.*?)</b>", node.get("label")).group(1)
            for node in dot.get_nodes() if node.get("label")}


def _edges(dot):
    titles = _titles(dot)
    return {(titles[edge.get_source()], titles[edge.get_destination()])
            for edge in dot.get_edges()}


def test_boxes_are_named_by_node_path_as_the_summary_names_them():
    passed = _passed()
    # the case: Keras's names for the layers are its counters, not the paths
    assert passed.kip_layer("blocks.1.att").name.startswith("multi_head_attention")
    dot = kip.model_to_dot(passed, show_shapes=True)
    titles = set(_titles(dot).values())
    assert titles == {"input"} | {node.name for node in passed.kip_graph.nodes}
    assert {"blocks.0.att", "blocks.1.att", "blocks.1.scale", "mlp.0", "head"} <= titles
    labels = " ".join(node.get("label") or "" for node in dot.get_nodes())
    assert "<b>blocks.1.att</b> (MultiHeadAttention)" in labels
    assert "multi_head_attention" not in labels and "dense_" not in labels
    assert "Output shape: <b>(None, 5, 1)</b>" in labels  # the head's, from the graph


def test_a_variable_read_is_not_drawn_as_fed_by_the_input():
    passed = _passed()
    keras_edges = _edges(keras.utils.model_to_dot(passed))
    # the case: Keras draws the tensor a read is anchored on as its input
    assert any(destination == "blocks.0.scale" for _, destination in keras_edges)
    edges = _edges(kip.model_to_dot(passed))
    assert not any(destination in ("blocks.0.scale", "blocks.1.scale")
                   for _, destination in edges)
    assert ("blocks.0.scale", "blocks.0.multiply") in edges
    assert ("input", "blocks.0.att") in edges and ("mlp.1", "head") in edges


def test_a_plugin_model_is_drawn_as_its_converted_graph():
    plugin = kip.PluginModel(Net(), passes=[kip.passes.Expand("all")])
    with pytest.raises(PassError, match="kip.model_to_dot: the PluginModel .* has not seen a batch"):
        kip.model_to_dot(plugin)
    plugin(X)
    titles = set(_titles(kip.model_to_dot(plugin)).values())
    assert titles == {"input"} | {node.name for node in plugin.converted.kip_graph.nodes}
    assert len(titles) > 10  # not one box for the whole model


def test_a_loaded_model_is_drawn_by_the_paths_it_saved(tmp_path):
    passed = _passed()
    passed.save(tmp_path / "passed.keras")
    loaded = keras.models.load_model(tmp_path / "passed.keras")
    assert loaded.kip_graph is None  # the paths come from the file
    assert _edges(kip.model_to_dot(loaded)) == _edges(kip.model_to_dot(passed))


def test_a_layer_called_twice_is_one_box_with_both_paths():
    class Twice(keras.Model):
        def __init__(self):
            super().__init__()
            self.shared = keras.layers.Dense(8)

        def call(self, x):
            return self.shared(self.shared(x))

    converted = kip.convert_to_functional(Twice(), X)
    assert set(_titles(kip.model_to_dot(converted)).values()) == {"input", "shared, shared_1"}


def test_a_subclassed_model_or_expand_nested_is_refused_saying_what_to_do():
    with pytest.raises(TypeError, match=r"which Keras would draw as one box.*convert_to_functional"):
        kip.model_to_dot(Net())
    with pytest.raises(ValueError, match=r"expand_nested=True is not supported.*Expand"):
        kip.model_to_dot(kip.convert_to_functional(Net(), X), expand_nested=True)


def test_without_pydot_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pydot", None)  # `import pydot` raises ImportError
    for draw in (lambda: kip.model_to_dot(_passed()),
                 lambda: kip.plot_model(_passed(), to_file=tmp_path / "m.png")):
        with pytest.raises(ImportError, match=r"pydot is not installed.*pip install pydot"
                                              r".*apt-get install graphviz"):
            draw()
    assert not (tmp_path / "m.png").exists()


def test_without_graphviz_an_image_is_an_error_saying_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    passed = _passed()
    with pytest.raises(ImportError, match=r"no `dot` program on PATH.*apt-get install graphviz"):
        kip.plot_model(passed, to_file=tmp_path / "m.png")
    assert not (tmp_path / "m.png").exists()
    # the dot source needs pydot alone
    kip.plot_model(passed, to_file=tmp_path / "m.dot", show_shapes=True)
    source = (tmp_path / "m.dot").read_text()
    assert source.startswith("digraph") and "<b>blocks.1.att</b> (MultiHeadAttention)" in source


@pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="graphviz's `dot` is not on PATH (apt-get install graphviz), so no image "
           "can be written; the drawing itself is checked by the tests above",
)
def test_plot_model_writes_the_image_with_the_paths(tmp_path):
    passed = _passed()
    kip.plot_model(passed, to_file=tmp_path / "passed.svg", show_shapes=True)
    svg = (tmp_path / "passed.svg").read_text()
    assert "blocks.1.att" in svg and "multi_head_attention" not in svg
    kip.plot_model(passed, to_file=tmp_path / "passed.png")
    assert (tmp_path / "passed.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
