"""The graph IR's editing primitives (users, insert, replace, erase), its one
namespace, its per-node metadata, and `lint()` catching each malformation."""

import keras
import numpy as np
import pytest

import keras_ipu_plugin as kip
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.ir.graph import Graph
from keras_ipu_plugin.ir.graph import GraphError
from keras_ipu_plugin.ir.graph import Node
from keras_ipu_plugin.ir.graph import Value
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.ir.graph import InputSpec

SPEC = keras.KerasTensor((None, 4))


def node(name, *inputs):
    """A node of a ReLU layer reading `inputs`, with one output."""
    made = Node(name, keras.layers.ReLU(name=name), tuple(inputs), {}, None)
    made.outputs = [Value(made, 0, SPEC)]
    return made


def chain(length=3):
    """input -> n0 -> n1 -> ... -> output."""
    x = Value(None, 0, SPEC)
    nodes, last = [], x
    for index in range(length):
        nodes.append(node(f"n{index}", last))
        last = nodes[-1].outputs[0]
    return Graph(InputSpec("x", (4,), "float32"), x, nodes, last, name="chain")


def names(graph):
    return [n.name for n in graph.nodes]


# -- users ---------------------------------------------------------------------
def test_users_follow_the_nodes_reading_a_value():
    graph = chain()
    n0, n1, n2 = graph.nodes
    assert list(graph.input_values.users) == [n0]
    assert n0.users == [n1] and n1.users == [n2] and n2.users == []
    n2.args = (n0.outputs[0], n0.outputs[0])  # read twice, listed once
    assert n0.users == [n1, n2] and n1.users == []
    graph.lint()


def test_detached_nodes_do_not_count_as_users():
    # Tracing makes nodes (one trace per training mode) before a graph has
    # them: the discarded ones must never show up as users.
    graph = chain()
    stray = node("stray", graph.nodes[0].outputs[0])
    assert stray not in graph.nodes[0].users
    graph.lint()


# -- insert --------------------------------------------------------------------
def test_insert_before_and_after_place_and_name_the_nodes():
    graph = chain()
    n0, n1, n2 = graph.nodes
    before = graph.insert_before(n1, node("n0", n0.outputs[0]))[0]
    after = graph.insert_after(n1, [node("a", n1.outputs[0]), node("a", n1.outputs[0])])
    assert before.name == "n0_1"  # the namespace numbers a taken name
    assert [n.name for n in after] == ["a", "a_1"]
    assert names(graph) == ["n0", "n0_1", "n1", "a", "a_1", "n2"]
    assert n1.users == [n2, *after] and before in n0.users
    graph.append(node("tail", n2.outputs[0]))
    assert names(graph)[-1] == "tail"
    graph.lint()


def test_edits_in_any_order_find_each_node_where_it_is():
    # Positions are searched from the last one found (Expand edits front to
    # back); edits back to front, and a list changed by hand, must still
    # find each node at its true place.
    graph = chain(6)
    n0, n1, n2, n3, n4, n5 = graph.nodes
    graph.insert_after(n4, node("late", n4.outputs[0]))
    graph.insert_before(n1, node("early", n0.outputs[0]))
    assert names(graph) == ["n0", "early", "n1", "n2", "n3", "n4", "late", "n5"]
    graph.replace_all_uses_with(n5.outputs[0], n4.outputs[0])
    graph.erase_node(n5)
    graph.nodes[:] = [n for n in graph.nodes if n.name != "late"] + [graph.node("late")]
    graph.insert_before(n2, node("mid", n1.outputs[0]))
    assert names(graph) == ["n0", "early", "n1", "mid", "n2", "n3", "n4", "late"]
    graph.lint()


def test_a_node_is_inserted_in_one_graph_only():
    graph = chain()
    with pytest.raises(GraphError, match="already in graph `chain`"):
        graph.append(graph.nodes[0])
    with pytest.raises(GraphError, match="not in graph"):
        graph.insert_before(node("elsewhere", graph.input_values), node("x"))


# -- replace all uses, erase ------------------------------------------------------
def test_replace_all_uses_with_rewires_users_and_outputs():
    graph = chain()
    n0, n1, n2 = graph.nodes
    changed = graph.replace_all_uses_with(n1.outputs[0], n0.outputs[0])
    assert changed == [n2] and n2.args == (n0.outputs[0],)
    assert n1.users == [] and n0.users == [n1, n2]
    graph.replace_all_uses_with(n2.outputs[0], n1.outputs[0])
    assert graph.outputs is n1.outputs[0]
    graph.lint()


def test_erase_node_refuses_a_node_still_read():
    graph = chain()
    n0, n1, n2 = graph.nodes
    with pytest.raises(GraphError, match="`n2` still read"):
        graph.erase_node(n1)
    with pytest.raises(GraphError, match="an output of the graph"):
        graph.erase_node(n2)
    graph.replace_all_uses_with(n1.outputs[0], n0.outputs[0])
    graph.erase_node(n1)
    assert names(graph) == ["n0", "n2"] and n0.users == [n2] and n1.graph is None
    assert "n1" not in graph.names  # the name is free again
    graph.lint()


# -- one namespace, one metadata dict ------------------------------------------------
def test_namespace_numbers_taken_names_linearly():
    names_ = Namespace(["dense", "dense_2"])
    assert [names_.create("dense") for _ in range(3)] == ["dense_1", "dense_3", "dense_4"]
    assert names_.create("norm") == "norm" and "norm" in names_


def test_copy_has_its_own_nodes_users_and_metadata():
    graph = chain()
    graph.nodes[0].annotations["recompute"] = True
    graph.nodes[0].meta["mine"] = [1]
    copied = graph.copy()
    copied.nodes[0].annotations["stage"] = 1
    copied.nodes[0].meta["mine"].append(2)
    assert graph.nodes[0].meta == {
        "annotations": {"recompute": True}, "opaque_reason": None,
        "made_by_pass": False, "from_blocks": [], "mine": [1]}
    assert copied.nodes[0].users == [copied.nodes[1]]
    copied.lint()
    graph.lint()


# -- lint --------------------------------------------------------------------------
def test_lint_catches_nodes_out_of_topological_order():
    graph = chain()
    graph.nodes[0], graph.nodes[1] = graph.nodes[1], graph.nodes[0]
    with pytest.raises(GraphError, match="`n1`.*not in topological order"):
        graph.lint()


def test_lint_catches_a_use_of_an_undefined_value():
    graph = chain()
    graph.nodes[1].args = (Value(None, 0, SPEC),)
    with pytest.raises(GraphError, match="`n1` reads .* not an input of this graph"):
        graph.lint()


def test_lint_catches_a_use_of_an_erased_node():
    graph = chain()
    n0, n1, n2 = graph.nodes
    graph.nodes = [n0, n2]  # by hand: n2 still reads n1
    with pytest.raises(GraphError, match="`n2` reads .*`n1`, which is not in the graph"):
        graph.lint()


def test_lint_catches_duplicate_names():
    graph = chain()
    graph.nodes[2].name = "n0"
    with pytest.raises(GraphError, match="two nodes are named `n0`"):
        graph.lint()


def test_lint_catches_a_rename_outside_the_namespace():
    graph = chain()
    graph.nodes[2].name = "renamed"
    with pytest.raises(GraphError, match="`renamed` was renamed outside"):
        graph.lint()


def test_lint_catches_users_out_of_sync():
    graph = chain()
    n0, n1, _ = graph.nodes
    n0.outputs[0].users.pop(n1)
    with pytest.raises(GraphError, match="`n1` reads .* whose users do not list it"):
        graph.lint()
    graph = chain()
    n0, _, n2 = graph.nodes
    n0.outputs[0].users[n2] = None
    with pytest.raises(GraphError, match="lists user `n2`, which does not read it"):
        graph.lint()


def test_lint_catches_nodes_put_in_the_list_by_hand():
    graph = chain()
    graph.nodes.append(node("stray", graph.nodes[-1].outputs[0]))
    with pytest.raises(GraphError, match="`stray` is in the node list but not in the graph"):
        graph.lint()
    graph = chain()
    graph.nodes.append(graph.nodes[0])
    with pytest.raises(GraphError, match="`n0` appears twice"):
        graph.lint()


def test_lint_catches_undefined_graph_outputs():
    graph = chain()
    graph.outputs = Value(None, 0, SPEC)
    with pytest.raises(GraphError, match="output .* not an input of this graph"):
        graph.lint()


def test_lint_catches_an_output_claiming_another_producer():
    graph = chain()
    graph.nodes[1].outputs[0].producer = graph.nodes[0]
    with pytest.raises(GraphError, match="output 0 of node `n1` says it is output 0 of `n0`"):
        graph.lint()


# -- lint after every pass, in the tests ----------------------------------------------
class _Small(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)


class _LeavesAStrayNode(kip.passes.Pass):
    """Appends a node to the list by hand, bypassing the primitives: the
    rebuilt model would simply ignore it, and nothing else would notice."""

    step = "stray"

    def run(self, graph, report):
        last = graph.nodes[-1]
        graph.nodes.append(node("stray", last.outputs[0]))
        return graph


def test_apply_passes_lints_the_graph_after_each_pass_in_tests():
    x = np.ones((2, 4), "float32")
    converted = kip.convert_to_functional(_Small(), x)
    with pytest.raises(PassError, match="after pass _LeavesAStrayNode: .*`stray`"):
        kip.apply_passes(converted, [kip.passes.Expand(), _LeavesAStrayNode()])


# -- Keras masks and None outputs ----------------------------------------------
def masked_chain():
    """input -> n0 -> n1 -> n2, n1's output carrying n0's output as its mask."""
    graph = chain()
    n0, n1, _ = graph.nodes
    n1.outputs[0].mask = n0.outputs[0]
    return graph


def test_replace_all_uses_with_moves_the_masks_that_refer_to_the_old_value():
    # A value whose Keras mask came from a replaced (inlined) node kept
    # pointing at the erased node's output: rebuilt, Keras would attach no
    # mask there, or the graph would not lint.
    graph = masked_chain()
    n0, n1, _ = graph.nodes
    new = graph.insert_after(n0, node("n0_new", graph.input_values))[0]
    graph.replace_all_uses_with(n0.outputs[0], new.outputs[0])
    assert n1.outputs[0].mask is new.outputs[0]
    assert list(new.outputs[0].masked) == [n1.outputs[0]]
    graph.erase_node(n0)
    graph.lint()


def test_erase_node_refuses_a_node_whose_output_is_still_a_mask():
    graph = masked_chain()
    n0, n1, n2 = graph.nodes
    n1.args = (graph.input_values,)  # n0 read by nobody, still n1's output's mask
    with pytest.raises(GraphError, match=r"`n0`.*Keras mask"):
        graph.erase_node(n0)


def test_copy_keeps_the_masks_within_the_copy():
    graph = masked_chain()
    graph.nodes[2].outputs[0].mask = kip.ir.graph.UNTRACED_MASK
    copied = graph.copy()
    n0, n1, n2 = copied.nodes
    assert n1.outputs[0].mask is n0.outputs[0]
    assert n2.outputs[0].mask == kip.ir.graph.UNTRACED_MASK
    assert list(graph.nodes[0].outputs[0].masked) == [graph.nodes[1].outputs[0]]
    copied.lint()


def test_lint_catches_a_mask_from_outside_the_graph():
    graph = chain()
    graph.nodes[1].outputs[0].mask = node("stray", graph.input_values).outputs[0]
    with pytest.raises(GraphError, match="Keras mask"):
        graph.lint()


def test_lint_accepts_none_among_the_outputs_and_checks_the_rest():
    graph = chain()
    n1 = graph.nodes[1]
    n1.output_structure = (0, None)  # the call returned (tensor, None)
    graph.lint()
    n1.output_structure = (0, 1, None)  # places an output the node lacks
    with pytest.raises(GraphError, match="output structure of node `n1`"):
        graph.lint()
