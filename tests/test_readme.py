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


def test_architecture_writing_a_pass_example_runs_and_its_pass_reads_from_configs(monkeypatch):
    import keras_ipu_plugin as kip
    from keras_ipu_plugin.passes import base

    monkeypatch.setattr(base, "_PASSES", dict(base._PASSES))  # the registry, restored after
    text = (README.parent / "docs" / "architecture.md").read_text()
    code = text[text.index("### Writing a pass"):].split("```python", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "docs/architecture.md", "exec"), namespace)
    tagged = namespace["tagged"]
    assert tagged.kip_annotations and all(
        annotations == {"tag": "x"} for annotations in tagged.kip_annotations.values()
    )
    assert kip.passes_from_config({"tag_dense": {"label": "y"}}) == [namespace["TagDense"]("y")]
