"""The README is a guide a newcomer can follow as written: every python
snippet runs, the test command is the one CI runs, it stays short, and no
document or comment in the repository speaks the team's private vocabulary."""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MINIMAL_EXAMPLE = "## A minimal example"


def _fenced_blocks(text):
    """(language, code, heading) of every fenced block, in order."""
    blocks, heading = [], ""
    lines = text.split("\n")
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = line
        if line.startswith("```"):
            language, body = line[3:].strip(), []
            index += 1
            while not lines[index].startswith("```"):
                body.append(lines[index])
                index += 1
            blocks.append((language, "\n".join(body) + "\n", heading))
        index += 1
    return blocks


def _python_block_after(heading):
    text = README.read_text()
    section = text[text.index(heading):]
    return section.split("```python", 1)[1].split("```", 1)[0]


def _snippets():
    """Every python block of the README but the minimal example, which each
    one continues."""
    minimal = _python_block_after(MINIMAL_EXAMPLE)
    return [(heading, code) for language, code, heading in _fenced_blocks(README.read_text())
            if language == "python" and code.strip() != minimal.strip()]


def test_the_readme_holds_the_snippets_it_promises():
    # The scan above must see the how-tos; a renamed fence would skip them.
    languages = {language for language, _, _ in _fenced_blocks(README.read_text())}
    assert languages <= {"python", "bash", "text", "yaml"}, languages
    assert len(_snippets()) >= 10


@pytest.mark.parametrize("index", range(len(_snippets())))
def test_every_readme_snippet_runs_after_the_minimal_example(index, tmp_path, monkeypatch, capsys):
    """Each python block runs as printed, after the minimal example, in a
    fresh namespace: what a reader pastes into a new session."""
    heading, snippet = _snippets()[index]
    monkeypatch.chdir(tmp_path)  # the snippets save and export files
    namespace = {}
    exec(compile(_python_block_after(MINIMAL_EXAMPLE), str(README), "exec"), namespace)
    exec(compile(snippet, f"{README} ({heading})", "exec"), namespace)
    if "create_feature_extractor" in snippet:
        assert "(64, 32) (64, 1)" in capsys.readouterr().out


def test_the_pipelined_training_snippet_learns():
    """The pipelining how-to trains a model whose loss can fall (a regression
    head with a regression loss), and it does fall."""
    snippet = next(code for _, code in _snippets() if "PipelineStages" in code)
    namespace = {}
    exec(compile(_python_block_after(MINIMAL_EXAMPLE), str(README), "exec"), namespace)
    exec(compile(snippet, str(README), "exec"), namespace)
    losses = namespace["history"].history["loss"]
    assert losses[-1] < losses[0] and losses[-1] > 0


def test_readme_minimal_example_runs_twice_in_one_process():
    # Twice: a notebook re-runs cells, and Keras's auto-generated layer names
    # then change; the example must not depend on them.
    code = _python_block_after(MINIMAL_EXAMPLE)
    for _ in range(2):
        namespace = {}
        exec(compile(code, str(README), "exec"), namespace)
        report = namespace["passed"].kip_report
        assert len(report.touched("recompute")) == 1  # the one LayerNormalization


def test_the_readme_test_command_is_the_one_ci_runs_and_the_readme_stays_a_guide():
    bash = [code.strip() for language, code, _ in _fenced_blocks(README.read_text())
            if language == "bash"]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1].strip()
    assert ci in bash
    assert bash[0].endswith("python3 examples/quickstart.py")
    assert len(README.read_text().splitlines()) <= 450


# Words that mean something only inside the team's way of working: a work
# period called a "stop", numbered work items, review rounds, and the notes
# folder of past branches. Written so that plain English ("stop training",
# "tracing stops", `tf.stop_gradient`, EarlyStopping) does not match.
PROCESS_WORDS = [
    r"\b(?:this|previous|last|latest|next|earlier|later) stop(?:'s)?\b",
    r"\b(?:earlier|previous|later|recent|two|three|four|five) stops\b",
    r"\bstops? ago\b",
    r"\bstop by stop\b",
    r"\bstop \d+\b",
    r"\bissues? #?\d+",
    r"(?<![a-z])round ?\d+(?!\d)",
    r"\bbranch[- ]notes\b",
]
TEXT_SUFFIXES = {".py", ".md", ".cfg", ".toml", ".txt", ".yaml", ".yml", ".sh", ".json", ""}


def _repository_text_files():
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
        paths = [ROOT / name for name in listed if name]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        paths = [path for path in ROOT.rglob("*")
                 if not any(part.startswith(".") and part != ".ci" or part == "__pycache__"
                            or part.endswith(".egg-info") for part in path.relative_to(ROOT).parts)]
    return [path for path in paths if path.is_file() and path.suffix in TEXT_SUFFIXES]


def test_process_words_match_only_what_they_should():
    # Each example is written in two parts, so that this file does not hold
    # the words it forbids.
    hits = ["".join(parts) for parts in [
        ("in the previous ", "stop"), ("Earlier ", "stops' runs"), ("two st", "ops ago"),
        ("iss", "ue 24's goal"), ("(iss", "ue 13)"), ("rou", "nd 3"), ("test_tracing_rou", "nd3"),
        ("docs/branch", "-notes/x.md"), ("Sto", "p 39")]]
    misses = ["stop training", "tracing stops at library code", "tf.stop_gradient",
              "EarlyStopping", "the exception that stops a trace", "around 3 MiB",
              "ops.arange(start=0, stop=n)", "round(x, 3)", "a known issue"]
    for text in hits:
        assert any(re.search(p, text, re.IGNORECASE) for p in PROCESS_WORDS), text
    for text in misses:
        assert not any(re.search(p, text, re.IGNORECASE) for p in PROCESS_WORDS), text


def test_no_process_words_anywhere_in_the_repository():
    """Documents, comments, docstrings and file names speak to users and
    maintainers, not to the team's process."""
    files = _repository_text_files()
    assert README in files and len(files) > 100  # the listing works
    found = []
    for path in files:
        relative = str(path.relative_to(ROOT))
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate([relative, *text.splitlines()]):
            for pattern in PROCESS_WORDS:
                match = re.search(pattern, line, re.IGNORECASE)
                if match:
                    where = relative if number == 0 else f"{relative}:{number}"
                    found.append(f"{where}: {match.group(0)!r}")
    assert not found, "process words: " + "; ".join(found)


def test_architecture_writing_a_pass_example_runs_and_its_pass_reads_from_configs(monkeypatch):
    import keras_ipu_plugin as kip
    from keras_ipu_plugin.passes.infra import base

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
