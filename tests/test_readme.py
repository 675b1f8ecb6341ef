"""The README's minimal example runs as printed (a newcomer copies it first)."""

import pathlib

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_block_after(heading):
    text = README.read_text()
    section = text[text.index(heading):]
    return section.split("```python", 1)[1].split("```", 1)[0]


def test_readme_minimal_example_runs_twice_in_one_process():
    # Twice: a notebook re-runs cells, and Keras's auto-generated layer names
    # then change; the example must not depend on them.
    code = _python_block_after("## A minimal example")
    for _ in range(2):
        namespace = {}
        exec(compile(code, str(README), "exec"), namespace)
        report = namespace["passed"].kip_report
        assert len(report.touched("recompute")) == 1  # the one LayerNormalization
