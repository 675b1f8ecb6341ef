"""The README's minimal example runs as printed (a newcomer copies it first)."""

import pathlib

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_block_after(heading):
    text = README.read_text()
    section = text[text.index(heading):]
    return section.split("```python", 1)[1].split("```", 1)[0]


def _python_blocks_of(heading):
    """Every python block of the section under `heading` (to the next `## `)."""
    text = README.read_text()
    section = text[text.index(heading) + len(heading):]
    section = section.split("\n## ", 1)[0]
    return [block.split("```", 1)[0] for block in section.split("```python")[1:]]


def test_every_how_to_snippet_runs_after_the_minimal_example(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the snippets save and export files
    snippets = _python_blocks_of("## How to")
    assert len(snippets) >= 6
    for snippet in snippets:
        namespace = {}
        exec(compile(_python_block_after("## A minimal example"), str(README), "exec"), namespace)
        exec(compile(snippet, str(README), "exec"), namespace)
    assert "(64, 32) (64, 1)" in capsys.readouterr().out


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
    from keras_ipu_plugin.passes.core import base

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


def _kip_names(text):
    """Every `kip.a.b` the text names (a sentence's closing dot is not part of it)."""
    import re

    return {match.rstrip(".") for match in re.findall(r"(?<![\w.])kip\.[A-Za-z_][\w.]*", text)}


def test_every_kip_name_the_readme_docs_examples_and_messages_mention_resolves():
    # A name that moved (kip.config -> kip.passes.config) must not stay in the
    # documentation or in an error message a user would follow.
    import keras_ipu_plugin as kip

    root = README.parent
    sources = [README, *sorted((root / "docs").rglob("*.md")),
               *sorted((root / "examples").rglob("*.py")),
               *sorted((root / "keras_ipu_plugin").rglob("*.py"))]
    mentioned = {}
    for source in sources:
        for name in _kip_names(source.read_text()):
            mentioned.setdefault(name, source.relative_to(root))
    assert {"kip.convert_to_functional", "kip.passes.Expand"} <= set(mentioned)  # the scan works
    unresolved = []
    for name, source in sorted(mentioned.items()):
        value = kip
        for part in name.split(".")[1:]:
            if not hasattr(value, part):
                unresolved.append(f"{name} ({source})")
                break
            value = getattr(value, part)
    assert not unresolved, "names that do not resolve on keras_ipu_plugin: " + ", ".join(unresolved)
