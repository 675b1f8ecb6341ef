"""`Replace`: swap layers for other (accelerator-optimised) layer classes.

Each target's nodes call a new layer made by its `Replacement` (see
`replacement.py`): one new layer per old layer, so layers shared between
call sites stay shared, or the layer an earlier conversion of the same
model made (trained since). Targets inside custom layers that are not
expanded are reached by expanding the layers that contain them, which the
report says. Inside Keras's own layers holding layers (an RNN's cell or a
layer the cell holds, Bidirectional, TimeDistributed) the node calls a new
holder built from the holder's config around the new layers
(`replacement.holder_with_replaced`). A matching layer out of reach (inside
a layer that cannot be expanded, a holder that cannot be rebuilt) is named
in the report as "not reached", with why; `strict=True` makes any such
layer an error instead.
"""

import keras

from keras_ipu_plugin.errors import ConfigError
from keras_ipu_plugin.errors import PassError
from keras_ipu_plugin.errors import config_path
from keras_ipu_plugin.errors import short_repr
from keras_ipu_plugin.ir.graph import Namespace
from keras_ipu_plugin.passes.infra.base import run_inside
from keras_ipu_plugin.passes.infra.base import split_targets
from keras_ipu_plugin.passes.infra.base import EQUAL
from keras_ipu_plugin.passes.infra.base import RUNS
from keras_ipu_plugin.passes.infra.base import Pass
from keras_ipu_plugin.passes.infra.base import as_targets
from keras_ipu_plugin.passes.infra.base import describe
from keras_ipu_plugin.passes.infra.base import nodes_matching
from keras_ipu_plugin.passes.infra.base import unmatched_target
from keras_ipu_plugin.passes.infra.base import register_pass
from keras_ipu_plugin.passes.infra.base import saved_config
from keras_ipu_plugin.passes.infra.base import targets_config
from keras_ipu_plugin.passes.infra.base import targets_from_config
from keras_ipu_plugin.passes.expand import expand_to_reach
from keras_ipu_plugin.passes.infra.patterns import Chain
from keras_ipu_plugin.passes.replacement import Replacement
from keras_ipu_plugin.passes.replacement import config_equivalent
from keras_ipu_plugin.passes.replacement import copy_weights_by_name  # noqa: F401 (re-exported)
from keras_ipu_plugin.passes.replacement import NotRebuilt
from keras_ipu_plugin.passes.replacement import holder_with_replaced
from keras_ipu_plugin.passes.replacement import new_layer_for
from keras_ipu_plugin.passes.infra.patterns import names_a_path


@register_pass("replace", order=1)
class Replace(Pass):
    """Replace matched layers: `Replace({target: Replacement(...)})`.

    `strict=True`: a matching layer the pass cannot reach is an error
    naming it, rather than a "not reached" row of the report.

    Example:
        ```python
        passed = kip.apply_passes(converted, [
            kip.passes.Replace({keras.layers.Dense: Replacement(MyDense, copy_weights=True)})])
        ```
    """

    step = "replace"

    def __init__(self, mapping, strict=False):
        if not isinstance(strict, bool):
            raise PassError(f"Replace: strict is True or False; got {short_repr(strict)}.")
        self.strict = strict
        if not isinstance(mapping, dict) or not mapping:
            raise PassError("Replace takes a non-empty dict {target: Replacement}.")
        for target, replacement in mapping.items():
            as_targets(target)
            if not isinstance(replacement, Replacement):
                raise PassError(
                    f"Replace: the value for {describe(target)} must be a "
                    f"Replacement; got {type(replacement).__name__}."
                )
        self.mapping = dict(mapping)

    # -- configs and saving ------------------------------------------------------
    def get_config(self):
        replacements = []
        for target, replacement in self.mapping.items():
            owner = f"Replace (the replacement of {describe(target)})"
            (target_config,) = targets_config([target], owner)
            replacements.append({"target": target_config, **replacement.get_config(owner)})
        return {"replacements": replacements, "strict": self.strict}

    @classmethod
    def from_config(cls, config):
        config = saved_config(config, "Replace", required=("replacements",),
                              optional=("strict",))
        if not isinstance(config["replacements"], list):
            raise PassError(f"Replace.from_config: replacements are a list; got "
                            f"{short_repr(config['replacements'])}.")
        mapping = {}
        for saved in config["replacements"]:
            if not isinstance(saved, dict) or "target" not in saved:
                raise PassError(f"Replace.from_config: a replacement is a mapping with a "
                                f"target; got {short_repr(saved)}.")
            saved = dict(saved)
            (target,) = targets_from_config([saved.pop("target")], "Replace")
            if target in mapping:
                raise PassError(f"Replace.from_config: {describe(target)} is replaced twice.")
            mapping[target] = Replacement.from_config(saved, f"Replace ({describe(target)})")
        return cls(mapping, strict=config.get("strict", False))

    @classmethod
    def from_user_config(cls, value, path, reader):
        """`replace: {Dense: {class: MyDense, params: {...}, copy_weights: true}}`."""
        if not isinstance(value, dict) or not value:
            raise ConfigError(path, "expected a mapping {target: {class: ..., params: ...}}")
        mapping = {}
        for target_name, spec in value.items():
            target_path = config_path(path, target_name)
            target = reader.target(target_name, target_path)
            if target in mapping:
                raise ConfigError(target_path, f"{describe(target)} is replaced twice")
            mapping[target] = Replacement.from_user_config(spec, target_path, reader)
        return cls(mapping)

    @property
    def claim(self):
        """EQUAL when every replacement copies the old weights and keeps the
        config; a new layer with fresh weights or other parameters computes
        something else on purpose (RUNS)."""
        if all(r.copy_weights and config_equivalent(r) for r in self.mapping.values()):
            return EQUAL
        return RUNS

    def run(self, graph, report, made=None):
        # One new layer per old layer, in this graph and in the modes'
        # graphs of its switches alike: both modes train the same weights.
        made = {} if made is None else made
        inside = {}
        for target, replacement in self.mapping.items():
            rebuilt = []
            unreached = expand_to_reach(
                graph, target, report, self.step,
                reach_inside=lambda node, target=target, replacement=replacement, rebuilt=rebuilt:
                self._rebuild_holder(graph, node, target, replacement, report, made, rebuilt))
            if unreached and self.strict:
                raise PassError(
                    f"replace (strict): {describe(target)} is not reached inside "
                    + "; ".join(f"`{name}` ({why})" for name, why in unreached) + ".")
            if isinstance(target, Chain):
                self._replace_runs(graph, target, replacement, report)
                continue
            here, within = split_targets(graph, [target])
            if within:
                inside[target] = replacement
            if not here:
                continue
            nodes = nodes_matching(graph, target)
            if not nodes and rebuilt:
                continue  # reached inside Keras's layers holding layers only
            if not nodes:
                raise unmatched_target("replace", target, graph)
            # The new layers are ours to name: after their node's path
            # (`block_1.conv1`) unless `params` names them, each name once.
            chosen = set(nodes)
            names = _names_taken(graph, lambda node: node not in chosen)
            for node in nodes:  # one new layer per old layer: sharing is kept
                old = node.operation
                key = (id(old), id(replacement))
                if key not in made:
                    made[key] = self._new_layer(graph, node, replacement, names, report)
                    graph.replaced.append((old, made[key]))
                elif (old, made[key]) not in graph.replaced:
                    graph.replaced.append((old, made[key]))
                    report.add(self.step, node.name, "replaced",
                               f"sharing the layer `{made[key].name}` made for `{old.name}`")
                node.operation = made[key]
                node.made_by_pass = True  # ours: keeps the name it was given
        run_inside(graph, list(inside), lambda targets: lambda branch: Replace(
            {t: inside[t] for t in targets}, strict=self.strict).run(branch, report, made=made))
        return graph

    def _rebuild_holder(self, graph, node, target, replacement, report, made, rebuilt):
        """Reach `target` inside one of Keras's layers holding layers (an
        RNN's cell, Bidirectional, TimeDistributed): the node calls a new
        holder built from its config around the new layers
        (`replacement.holder_with_replaced`), one per old holder; None when
        done, else the reason it cannot be."""
        old = node.operation
        key = (id(old), id(replacement))
        if key not in made:
            aliases = not names_a_path(graph, target)

            def is_target(layer, path):
                if isinstance(target, str):
                    return path == target or (aliases and layer.name == target)
                return isinstance(target, type) and isinstance(layer, target)

            names = _names_taken(graph, lambda other: other.operation is not old)
            try:
                new, paths, detail = holder_with_replaced(
                    node, is_target, replacement, names.create(node.name))
            except NotRebuilt as error:
                return error.reason
            made[key] = new
            graph.replaced.append((old, new))
            report.add(self.step, node.name, "replaced", detail)
        else:
            report.add(self.step, node.name, "replaced",
                       f"sharing the layer `{made[key].name}` made for `{old.name}`")
        for other in graph.nodes:  # every call site of the holder
            if other.operation is old:
                other.operation = made[key]
                other.made_by_pass = True
        rebuilt.append(node.name)
        return None

    def _replace_runs(self, graph, chain, replacement, report):
        """Each run of nodes `chain` matches becomes one node calling a new
        layer made from the run's first layer (one per first layer: sharing
        is kept), reading the run's inputs; the rest of the run is erased."""
        runs = chain.matches(graph)
        if not runs:
            raise PassError(f"replace: target {describe(chain)} matches nothing in "
                            f"the model `{graph.name}`.")
        replaced = {id(node) for run in runs for node in run}
        names = _names_taken(graph, lambda node: id(node) not in replaced)
        new_layers = {}
        for run in runs:
            first, last = run[0], run[-1]
            old = first.operation
            if id(old) not in new_layers:
                name = names.create(replacement.params.get("name", first.name))
                new, detail = new_layer_for(first, replacement, name, run=run)
                new_layers[id(old)] = new
                graph.replaced.append((old, new))
                report.add(self.step, first.name, "replaced",
                           f"{chain.describe()} ({', '.join(n.name for n in run)}): {detail}")
            else:
                report.add(self.step, first.name, "replaced",
                           f"{chain.describe()}, sharing the layer made for `{old.name}`")
            first.operation = new_layers[id(old)]
            first.made_by_pass = True
            first.outputs[0].spec = last.outputs[0].spec
            graph.replace_all_uses_with(last.outputs[0], first.outputs[0])
            for node in reversed(run[1:]):
                graph.erase_node(node)

    def _new_layer(self, graph, node, replacement, names, report):
        old, reused = node.operation, graph.reusable.get(id(node.operation))
        if isinstance(reused, replacement.new_class):
            # Made by an earlier conversion of this model and trained since:
            # its weights (and the optimizer's state for them) go on.
            names.add(reused.name)
            report.add(self.step, node.name, "replaced",
                       f"{type(old).__name__} -> {type(reused).__name__}, "
                       f"the layer `{reused.name}` of an earlier conversion")
            return reused
        name = names.create(replacement.params.get("name", node.name))
        new, detail = new_layer_for(node, replacement, name)
        report.add(self.step, node.name, "replaced", detail)
        return new


def _names_taken(graph, kept):
    """The Keras names a new layer must not take: the model's inputs' and
    those of the operations of the nodes `kept(node)` keeps."""
    names = Namespace(spec.name for spec in keras.tree.flatten(graph.input_specs))
    for node in graph.nodes:
        if kept(node):
            names.add(getattr(node.operation, "name", None))
    return names

