"""Measured per-stage step time of pipeline stages planned by
`PipelineStages(num_stages=N, balance="time")`, against the splits a user
would write by hand.

Models (the gallery's, at a size where a stage's step takes milliseconds):
- `resnet`: `examples/resnet_blocks.py`'s `SmallResNet` with four residual
  blocks (widths 16, 32, 64, 64), 32x32 images, batch 32;
- `transformer`: `examples/text_transformer.py`'s `TextClassifier`, 4
  blocks, width 128, 4 heads, 64 tokens, batch 32.
Both expanded (`Expand()`) into their Keras layers first, as the gallery
does, so that a stage may end inside a block.

Splits, each contiguous over the graph's nodes in topological order:
- `layers`: the same number of nodes per stage (a split by layer count);
- `params`: `PipelineStages(num_stages=N, balance="params")`, the weights
  balanced (what a user balancing by parameter count writes);
- `time`: `PipelineStages(num_stages=N, balance="time")`, each node's
  forward and backward timed alone on the first batch's shapes, then the
  plan re-planned on its whole stages timed (on random inputs).
The "planned" column is the pass's own figure: for `time`, the imbalance of
the stages it timed.

A stage's time is not the sum of its nodes' times: on the ResNet, nodes timed
alone summed to 2.5x their stage, and unevenly (neighbouring ops fuse, per-call
costs are paid once per stage); a split balanced on node times alone measured
1.25 for 2 stages.

How a stage's step time is measured (independently of the planner: in
this script's own rounds, on real activations): the stage's nodes form one sub-graph, the inputs it reads
from earlier stages and the outputs later stages read (or the model's); one
`tf.function` runs its forward pass under a `GradientTape` on the
activations the first batch really gives at its inputs (the whole model run
forward once), then its backward pass from random output gradients to its
inputs and trainable weights, and returns the gradients. The stages of all
splits are timed in interleaved rounds (every stage once per round, after
two warm-up calls) and each stage's median over the rounds is its time, so
that the machine's load hits every split alike. Imbalance is the largest
stage time over the mean (1.0: perfectly balanced; a pipeline runs at the
pace of its slowest stage). Goal: <= 1.15 with balance="time".

Each (model, stages) pair runs in its own process.

    python benchmarks/pipeline_balance.py                    # all
    python benchmarks/pipeline_balance.py resnet --stages 2 --rounds 15
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STAGES, ROUNDS, BATCH = (2, 4), 21, 32
RESNET = dict(widths=(16, 32, 64, 64), size=32)
TEXT = dict(vocab=1000, length=64, dim=128, heads=4, classes=2, blocks=4)
SPLITS = ("layers", "params", "time")
GOAL = 1.15


# -- the child: one model, one number of stages -----------------------------------------
def child(model_name, num_stages, rounds):
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    import keras
    import numpy as np

    import keras_ipu_plugin as kip
    from keras_ipu_plugin.planning import graph_planning as planning
    from keras_ipu_plugin.planning import stage_balance
    from keras_ipu_plugin.passes.infra.manager import graph_of

    keras.utils.set_random_seed(0)
    model, x = _model_and_batch(model_name, keras, np)
    expanded = kip.apply_passes(kip.convert_to_functional(model, x, verify=False),
                                [kip.passes.Expand()], verify=False)
    graph = graph_of(expanded)
    nodes = graph.nodes
    splits = {}
    # By layer count: equal node counts, cut only where the planner may cut.
    even = stage_balance.balanced_partition([1.0] * len(nodes), num_stages,
                                            planning._allowed_cuts(nodes))
    splits["layers"] = [[node.name for node in nodes[first:last + 1]] for first, last in even]
    planned = {}
    for balance in ("params", "time"):
        start = time.perf_counter()
        passed = kip.apply_passes(
            expanded, [kip.passes.PipelineStages(num_stages=num_stages, balance=balance)],
            verify=False)
        seconds = time.perf_counter() - start
        table = next(plan for plan in passed.kip_report.plans
                     if plan.title.startswith("Pipeline stages"))
        splits[balance] = table.figures["stages"]
        planned[balance] = {"imbalance": table.figures["imbalance"], "pass_s": seconds}
    times = _measure_stages(graph, splits, x, rounds)
    print(json.dumps({
        "nodes": len(nodes),
        "splits": {name: [len(stage) for stage in stages] for name, stages in splits.items()},
        "bounds": {name: [(stage[0], stage[-1]) for stage in stages]
                   for name, stages in splits.items()},
        "stage_s": times,
        "planned": planned,
    }))


def _model_and_batch(model_name, keras, np):
    sys.path.insert(0, str(EXAMPLES))
    rng = np.random.default_rng(0)
    if model_name == "resnet":
        import resnet_blocks

        model = resnet_blocks.SmallResNet(widths=RESNET["widths"])
        size = RESNET["size"]
        x = rng.normal(size=(BATCH, size, size, resnet_blocks.CHANNELS)).astype("float32")
        return model, x
    import text_transformer

    model = text_transformer.TextClassifier(**TEXT)
    x = rng.integers(1, TEXT["vocab"], size=(BATCH, TEXT["length"])).astype("int32")
    x[:, -TEXT["length"] // 4:] = 0  # some padding, as real batches have
    return model, x


def _measure_stages(graph, splits, x, rounds):
    """{split: [median seconds of each stage's forward and backward]}."""
    import keras
    import numpy as np
    import tensorflow as tf

    values = _forward_values(graph, x)
    functions = {name: [_stage_function(graph, stage, values) for stage in stages]
                 for name, stages in splits.items()}
    runs = {name: [[] for _ in stages] for name, stages in splits.items()}
    for attempt in range(rounds + 2):  # two warm-up rounds
        for name, stages in functions.items():
            for index, (function, arguments) in enumerate(stages):
                start = time.perf_counter()
                for result in function(*arguments):
                    result.numpy()  # wait for it
                if attempt >= 2:
                    runs[name][index].append(time.perf_counter() - start)
    del keras, np, tf
    return {name: [statistics.median(r) for r in stage_runs] for name, stage_runs in runs.items()}


def _forward_values(graph, x):
    """{id(value): tensor}: every value of the graph on the first batch, in
    a training-mode forward pass on the model's weights as they are (read
    through a StatelessScope: no variable is written)."""
    import keras

    from keras_ipu_plugin import _compat
    from keras_ipu_plugin.planning import node_costs

    from keras_ipu_plugin.runtime.interpreter import call_arguments
    from keras_ipu_plugin.runtime.interpreter import output_tensors

    tensors = dict(zip(keras.tree.flatten(graph.input_values),
                       (keras.ops.convert_to_tensor(t) for t in keras.tree.flatten(x))))
    weights = _weights_of(graph.nodes)
    with _compat.stateless_scope([(v, v.value) for v in weights]):
        for node in graph.nodes:
            args, kwargs = call_arguments(node, tensors, node_costs.TRAINING)
            outputs = output_tensors(node, node.operation(*args, **kwargs))
            tensors.update(zip(node.outputs, outputs))
    return tensors


def _weights_of(nodes):
    seen, weights = set(), []
    for node in nodes:
        for variable in getattr(node.operation, "weights", []):
            if id(variable) not in seen:
                seen.add(id(variable))
                weights.append(variable)
    return weights


def _stage_function(graph, names, values):
    """(a traced forward-and-backward of the stage `names`, its arguments)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from keras_ipu_plugin.planning import node_costs
    from keras_ipu_plugin.planning.stage_timing import stage_forward_and_backward

    wanted = set(names)
    nodes = [node for node in graph.nodes if node.name in wanted]
    if len(nodes) != len(names):
        raise RuntimeError(f"stage nodes not found in the graph: {sorted(wanted)}")
    produced = {id(v) for node in nodes for v in node.outputs}
    inputs, seen = [], set()
    for node in nodes:
        for value in node.input_values:
            if id(value) not in produced and id(value) not in seen:
                seen.add(id(value))
                inputs.append(value)
    read_later = {id(v) for node in graph.nodes if node.name not in wanted
                  for v in node.input_values}
    read_later |= {id(v) for v in keras.tree.flatten(graph.outputs)}
    outputs = [v for node in nodes for v in node.outputs
               if id(v) in read_later and node_costs._floating(v.spec.dtype)]
    weights = _weights_of(nodes)
    trainable = {id(v) for node in nodes for v in getattr(node.operation, "trainable_weights", [])}
    rng = np.random.default_rng(0)
    upstream = [tf.constant(rng.normal(size=values[v].shape) * 0.1, values[v].dtype)
                for v in outputs]

    # The same forward and backward pass the planner times its stages with.
    forward_and_backward = stage_forward_and_backward(nodes, inputs, weights, trainable, outputs)

    arguments = ([values[v] for v in inputs], [v.value for v in weights], upstream)
    return tf.function(forward_and_backward, autograph=False), arguments


# -- the parent: one process per (model, stages), a table --------------------------------
def run(model_name, num_stages, rounds):
    out = subprocess.run(
        [sys.executable, __file__, "--child", model_name, str(num_stages), str(rounds)],
        check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def imbalance(times):
    return max(times) / (sum(times) / len(times))


def report(model_name, num_stages, result):
    print(f"\n== {model_name}, {num_stages} stages ({result['nodes']} nodes) ==")
    print(f"{'split':<8}{'nodes per stage':<20}{'stage step ms':<32}{'imbalance':>10}"
          f"{'planned':>9}")
    for name in SPLITS:
        times = result["stage_s"][name]
        planned = result["planned"].get(name, {}).get("imbalance")
        print(f"{name:<8}{' / '.join(map(str, result['splits'][name])):<20}"
              f"{' / '.join(f'{t * 1e3:.1f}' for t in times):<32}{imbalance(times):>10.2f}"
              + (f"{planned:>9.2f}" if planned is not None else f"{'':>9}"))
    measured = imbalance(result["stage_s"]["time"])
    print(f"goal balance='time' imbalance <= {GOAL}: {measured:.2f} "
          f"({'met' if measured <= GOAL else 'NOT met'}); planning took "
          f"{result['planned']['time']['pass_s']:.1f} s")
    return measured


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="*", choices=["resnet", "transformer", []])
    parser.add_argument("--stages", nargs="+", type=int, default=list(STAGES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    summary = []
    for model_name in args.models or ["resnet", "transformer"]:
        for num_stages in args.stages:
            result = run(model_name, num_stages, args.rounds)
            summary.append((model_name, num_stages, report(model_name, num_stages, result),
                            {name: imbalance(result["stage_s"][name]) for name in SPLITS}))
    print("\nmeasured imbalance (largest / mean stage step time)")
    print(f"{'model':<13}{'stages':>7}" + "".join(f"{name:>9}" for name in SPLITS))
    for model_name, num_stages, _, by_split in summary:
        print(f"{model_name:<13}{num_stages:>7}"
              + "".join(f"{by_split[name]:>9.2f}" for name in SPLITS))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
