"""The report of a conversion and its passes.

Example:
    ```python
    print(converted.kip_report)       # a table: pass, layer, action, detail
    converted.kip_report.touched("expand")
    # -> ['block_1', 'block_2']
    ```
"""

import contextlib
import io
import shutil
import time
from dataclasses import dataclass
from dataclasses import field

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class Entry:
    """One thing a step did to one layer (or node) of the graph."""

    step: str  # "convert", "expand", "replace", ...
    layer: str
    action: str
    detail: str = ""


@dataclass(frozen=True)
class PlanTable:
    """A planning pass's plan, shown after the report's table: a `title`,
    `columns` and `rows` (tuples of strings), and the plan's `figures` as
    data (estimates, node names), which the table does not show as such."""

    title: str
    columns: tuple
    rows: tuple
    figures: dict = field(default_factory=dict, compare=False)

    def table(self):
        table = Table(title=self.title)
        for column in self.columns:
            table.add_column(column)
        for row in self.rows:
            table.add_row(*row)
        return table


@dataclass
class Report:
    """What conversion and each pass did, and which layers stayed opaque;
    `plans` hold the tables of the planning passes (`PlanTable`)."""

    entries: list = field(default_factory=list)
    opaque: dict = field(default_factory=dict)  # layer name -> reason
    metrics: dict = field(default_factory=dict)  # e.g. graph sizes
    plans: list = field(default_factory=list)
    timings: list = field(default_factory=list)  # (step, model or layer, seconds)

    def add(self, step, layer, action, detail=""):
        self.entries.append(Entry(step, layer, action, detail))

    def add_once(self, step, layer, action, detail=""):
        """`add`, unless the same row is there already (a row added each
        time a step function is made, or a method is routed)."""
        entry = Entry(step, layer, action, detail)
        if entry not in self.entries:
            self.entries.append(entry)

    def add_plan(self, plan):
        self.plans.append(plan)

    def add_opaque(self, layer, reason):
        self.opaque[layer] = reason

    def add_verification(self, layer, verification, step="verify"):
        """One row saying what a verification compared (rows of the batch,
        outputs, gradients, the largest differences): a `verify.Verification`."""
        self.add(step, layer, verification.action, verification.describe())

    @contextlib.contextmanager
    def timed(self, step, name):
        """Time the block as `step` of `name` (kept when it succeeds).

        Example:
            ```python
            with report.timed("expand", "net"):
                graph = one_pass.run(graph, report)
            report.timings[-1][:2]
            # -> ('expand', 'net')
            ```
        """
        start = time.perf_counter()
        yield
        self.timings.append((step, name, time.perf_counter() - start))

    def progress_lines(self):
        """One line per timed step: `kip: expand `net` in 0.41 s`."""
        return [f"kip: {step} `{name}` in {seconds:.2f} s"
                for step, name, seconds in self.timings]

    def touched(self, step):
        """Names of the layers that `step` touched, in order."""
        return [entry.layer for entry in self.entries if entry.step == step]

    def extend(self, other):
        self.entries.extend(other.entries)
        self.opaque.update(other.opaque)
        self.metrics.update(other.metrics)
        self.plans.extend(other.plans)
        self.timings.extend(other.timings)

    def copy(self):
        return Report(list(self.entries), dict(self.opaque), dict(self.metrics), list(self.plans),
                      list(self.timings))

    def table(self):
        table = Table(title="keras_ipu_plugin report")
        for column in ("step", "layer", "action", "detail"):
            table.add_column(column)
        for entry in self.entries:
            table.add_row(entry.step, entry.layer, entry.action, entry.detail)
        for layer, reason in self.opaque.items():
            table.add_row("opaque", layer, "kept as one node", reason)
        for name, value in self.metrics.items():
            table.add_row("metric", name, str(value), "")
        return table

    def tables(self):
        """The report's table, then each plan's."""
        return [self.table()] + [plan.table() for plan in self.plans]

    def __str__(self):
        return "".join(render(table) for table in self.tables())


def graph_table(graph):
    """A rich table of the graph's nodes: the `model.summary()` companion
    that shows what Keras's summary cannot (node paths, pinned `training`,
    pass annotations, opaque reasons)."""
    table = Table(title=f"keras_ipu_plugin graph of {graph.name!r}")
    for column in ("node", "layer class", "training", "annotations", "opaque reason"):
        table.add_column(column)
    for row in graph.summary_rows():
        table.add_row(*row)
    return table


def summary(model, print_fn=None):
    """Keras's `model.summary()` followed by the plugin's graph table and report.

    Example:
        ```python
        kip.summary(passed)     # layers, then nodes with their annotations
        ```
    """
    print_fn = print_fn or print
    model.summary(print_fn=print_fn)
    graph = getattr(model, "kip_graph", None)
    for table in ([graph_table(graph)] if graph is not None else []) + (
        model.kip_report.tables() if getattr(model, "kip_report", None) else []
    ):
        print_fn(render(table))


def render(table):
    """`table` as text as wide as the terminal (its `COLUMNS` when set;
    120 columns where there is no terminal, e.g. output to a file)."""
    buffer = io.StringIO()
    width = shutil.get_terminal_size(fallback=(120, 24)).columns
    Console(file=buffer, width=width, force_terminal=False).print(table)
    return buffer.getvalue()
