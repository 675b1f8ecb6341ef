"""What several test files check of a converted graph: every node of it,
the bodies of its training switches included, and a model's outputs in
each `training` mode against the original's."""

import numpy as np


def all_nodes(graph):
    """The graph's nodes and, depth first, those of every branch graph a
    node holds (a `ModeSwitch`'s training and inference bodies)."""
    nodes = []
    for node in graph.nodes:
        nodes.append(node)
        for branch in getattr(node.operation, "branch_graphs", {}).values():
            nodes.extend(all_nodes(branch))
    return nodes


def outputs_in_every_mode(original, other, x):
    """Assert both models' outputs are equal with training True, False and
    None, each run from the same non-trainable variable state; return the
    last mode's pair."""
    state = [(v, v.numpy()) for v in original.non_trainable_variables]
    for training in (True, False, None):
        results = []
        for model in (original, other):
            for variable, value in state:
                variable.assign(value)
            results.append(np.asarray(model(x, training=training)))
        for variable, value in state:
            variable.assign(value)
        np.testing.assert_allclose(results[1], results[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"training={training}")
    return results
