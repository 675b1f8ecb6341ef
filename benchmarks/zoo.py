"""The zoo scoreboard: every corpus model of `tests/zoo/` through the checks
of `tests/zoo/harness.py`, as a table.

Columns: model | traced | expand equal | custom layers left | to_keras (a
model of Keras's own classes computing the expanded model's outputs: its
file loads without kip; n/a where nodes need kip) | replace reach | fit equal (PluginModel, PluginCallback; PluginModel with Expand("all")
and Adam, with Recompute(auto=True)) | time, then one line per check
that did not pass, with its reason (an error's first line). Each check runs
in this process inside its own try/except (`tests/zoo/harness.py`), so one
failure never stops the board.

Usage:
    python benchmarks/zoo.py                  # every model
    python benchmarks/zoo.py vit gpt2         # a subset
    python benchmarks/zoo.py --fast           # skip the models marked SLOW
    python benchmarks/zoo.py --checks traced expand
    python benchmarks/zoo.py vae --traceback  # errors with their tracebacks
    python benchmarks/zoo.py --list
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# The repository (its package, installed or not) and its tests (the corpus).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from zoo import MODELS  # noqa: E402
from zoo import harness  # noqa: E402

SYMBOLS = {harness.PASS: "yes", harness.FAIL: "NO", harness.ERROR: "ERROR", harness.NA: "n/a"}
STYLES = {harness.PASS: "green", harness.FAIL: "red", harness.ERROR: "bold red", harness.NA: "dim"}
COLUMNS = (
    ("traced", "traced"),
    ("expand", "expand equal"),
    ("custom_left", "custom layers left"),
    ("to_keras", "to_keras"),
    ("replace", "replace reach"),
    ("plugin_model", "fit equal\nPluginModel"),
    ("plugin_callback", "fit equal\nPluginCallback"),
    ("fit_expand", "fit equal\nExpand, Adam"),
    ("fit_recompute", "fit equal\nwith Recompute"),
)


def cell(result):
    """The table's short form of one result."""
    if result is None:
        return ""
    text = SYMBOLS[result.status]
    if result.check == "custom_left" and result.status in (harness.PASS, harness.FAIL):
        left = result.detail.split(" left", 1)[0]
        text = "0" if result.detail == "none" else (
            f"{left} (reasons)" if result.status == harness.PASS else f"{left}"
        )
    elif result.check == "replace" and result.status in (harness.PASS, harness.FAIL):
        reach = [part.split(" reached")[0].split(": ")[-1]
                 for part in result.detail.split("; ") if " reached" in part]
        text = (", ".join(reach) or text) + ("" if result.status == harness.PASS else " NO")
    return f"[{STYLES[result.status]}]{text}[/]"


def scoreboard(rows):
    table = Table(title="keras_ipu_plugin zoo scoreboard", show_lines=False)
    table.add_column("model")
    for _, title in COLUMNS:
        table.add_column(title)
    table.add_column("time", justify="right")
    table.add_column("first problem")
    for name, results in rows:
        by_check = {result.check: result for result in results}
        problems = [r for r in results if not r.ok]
        first = f"{problems[0].check}: {problems[0].detail}" if problems else ""
        table.add_row(
            name, *(cell(by_check.get(check)) for check, _ in COLUMNS),
            f"{sum(r.seconds for r in results):.0f} s",
            first[:160] + ("..." if len(first) > 160 else ""),
        )
    return table


def totals(rows):
    lines = []
    for check, title in COLUMNS:
        results = [r for _, rs in rows for r in rs if r.check == check]
        if results and check == "to_keras":  # n/a is ok there, but no model served
            served = sum(r.status == harness.PASS for r in results)
            lines.append(f"served by to_keras (a file plain Keras loads): "
                         f"{served}/{len(results)} models")
        elif results:
            passed = sum(r.ok for r in results)
            lines.append(f"{title.replace(chr(10), ' ')}: {passed}/{len(results)}")
    builtin_only = [r for _, rs in rows for r in rs if r.check == "custom_left"]
    if builtin_only:  # the goal: >= 90% expand to built-in layers only
        lines.append(f"expand to built-in layers only: "
                     f"{sum(r.detail == 'none' for r in builtin_only)}/{len(builtin_only)}")
    return "; ".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="a subset of the corpus (default: all)")
    parser.add_argument("--checks", nargs="+", choices=harness.CHECKS, default=list(harness.CHECKS))
    parser.add_argument("--fast", action="store_true", help="skip models marked SLOW")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of each error")
    parser.add_argument("--list", action="store_true", help="list the corpus and exit")
    args = parser.parse_args(argv)

    console = Console(width=200)
    if args.list:
        for name in MODELS:
            subject = harness.Subject(name)
            summary = " ".join(subject.doc.split())
            console.print(f"{name}{' (slow)' if subject.slow else ''}: {summary[:150]}...",
                          markup=False, highlight=False)
        return 0
    unknown = [name for name in args.models if name not in MODELS]
    if unknown:
        parser.error(f"not in the corpus: {', '.join(unknown)} (see --list)")
    names = args.models or list(MODELS)
    if args.fast:
        names = [name for name in names if not harness.Subject(name).slow]

    rows, start = [], time.perf_counter()
    for name in names:
        results = harness.check_model(name, args.checks)
        rows.append((name, results))
        console.print(f"[dim]{name}: " + ", ".join(f"{r.check} {r.status}" for r in results)
                      + f" ({sum(r.seconds for r in results):.0f} s)[/]")

    console.print(scoreboard(rows))
    console.print(totals(rows) + f" — {time.perf_counter() - start:.0f} s in all")
    console.print("\nEvery check that did not pass:")
    for name, results in rows:
        for result in results:
            if result.ok:
                continue
            console.print(f"- {name} / {result.check} / {result.status}: {result.detail}",
                          markup=False, highlight=False)
            if args.traceback and result.trace:
                console.print(result.trace, markup=False, highlight=False)
    return 0  # a scoreboard, printed; tests/test_zoo.py asserts


if __name__ == "__main__":
    sys.exit(main())
