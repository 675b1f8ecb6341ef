"""`python -m keras_ipu_plugin inspect` on a gallery model."""

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keras_ipu_plugin import cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RESNET = f"{EXAMPLES / 'resnet_blocks.py'}:SmallResNet"
SEQ2SEQ = f"{EXAMPLES / 'seq2seq.py'}:Seq2Seq"


def test_inspect_prints_the_report_and_the_graph_summary(capsys):
    assert cli.main(["inspect", RESNET, "--data-shape", "16,16,3"]) == 0
    out = capsys.readouterr().out
    assert "inputs: float32[2, 16, 16, 3]" in out
    assert "keras_ipu_plugin report" in out
    assert "│ convert │ blocks.0" in out                    # the report's rows, by path
    assert 'Model: "small_res_net_functional"' in out      # the summary
    assert "blocks.1 (ResidualBlock)" in out and "Total params" in out  # by path


def test_inspect_applies_a_passes_config(tmp_path, capsys):
    config = tmp_path / "passes.yaml"
    config.write_text("expand: all\nrecompute: [blocks.0.bn_2]\n")
    assert cli.main(["inspect", RESNET, "--data-shape", "16x16x3", "--passes", str(config)]) == 0
    out = capsys.readouterr().out
    assert "│ expand    │ blocks.0" in out
    assert "│ recompute │ blocks.0.bn_2" in out
    summary = out.split("Model: ", 1)[1]
    assert "blocks.1.conv_1 " in summary  # the passed graph's nodes, by path


def test_inspect_named_integer_inputs_make_a_dict(capsys):
    argv = ["inspect", SEQ2SEQ, "--data-shape", "source=6", "--data-shape", "target_in=6",
            "--dtype", "int32", "--int-range", "2,12"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "inputs: source: int32[2, 6], target_in: int32[2, 6]" in out
    assert "source (InputLayer)" in out and "target_in (InputLayer)" in out


@pytest.mark.skipif(
    shutil.which("dot") is None,
    reason="graphviz's `dot` is not on PATH (apt-get install graphviz), so "
           "keras.utils.plot_model cannot draw",
)
def test_plot_writes_a_png(tmp_path, capsys):
    # pydot comes with the `plot` extra; where `dot` exists it must be there too.
    out_file = tmp_path / "plots" / "resnet.png"
    assert cli.main(["inspect", RESNET, "--data-shape", "16,16,3", "--plot", str(out_file)]) == 0
    assert out_file.is_file() and out_file.stat().st_size > 1000
    assert out_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {out_file}" in capsys.readouterr().out
    svg_file = tmp_path / "resnet.svg"  # the boxes are named by path, as the summary's rows
    assert cli.main(["inspect", RESNET, "--data-shape", "16,16,3", "--plot", str(svg_file)]) == 0
    svg = svg_file.read_text()
    assert "blocks.1" in svg and "residual_block" not in svg


def test_plot_to_a_dot_file_needs_no_graphviz_and_names_the_nodes_by_path(
        tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no graphviz
    out_file = tmp_path / "resnet.dot"
    assert cli.main(["inspect", RESNET, "--data-shape", "16,16,3", "--plot", str(out_file)]) == 0
    source = out_file.read_text()
    assert "<b>blocks.1</b> (ResidualBlock)" in source and "residual_block" not in source


def test_plot_without_pydot_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    real_import = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name == "pydot" or name.startswith("pydot."):
            raise ImportError("No module named 'pydot'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", import_module)
    out_file = tmp_path / "resnet.png"
    code = cli.main(["inspect", RESNET, "--data-shape", "16,16,3", "--plot", str(out_file)])
    assert code == 2
    err = capsys.readouterr().err
    assert "pydot is not installed" in err and "pip install pydot" in err
    assert "graphviz" in err
    assert not out_file.exists()


def test_plot_without_graphviz_says_so_and_exits_2(tmp_path, monkeypatch, capsys):
    pytest.importorskip("pydot", reason="this test is about `dot` missing once pydot imports")
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    code = cli.main(["inspect", RESNET, "--data-shape", "16,16,3",
                     "--plot", str(tmp_path / "resnet.png")])
    assert code == 2
    assert "no `dot` on PATH" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "no_such_file.py:Model", "--data-shape", "4"], "no such file"),
    (["inspect", str(EXAMPLES / "vae.py"), "--data-shape", "4"], "expected FILE.py:NAME"),
    (["inspect", f"{EXAMPLES / 'vae.py'}:Nope", "--data-shape", "4"], "has no `Nope`"),
    (["inspect", f"{EXAMPLES / 'vae.py'}:make_data", "--data-shape", "4"], "not a keras.Model"),
    (["inspect", RESNET, "--data-shape", "16,a"], "dimensions must be integers"),
    (["inspect", RESNET, "--data-shape", "4", "--data-shape", "4",
      "--dtype", "int32", "--dtype", "int32", "--dtype", "int32"], "once per --data-shape"),
])
def test_usage_errors_are_one_line_with_exit_code_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_a_model_that_rejects_the_data_fails_with_exit_code_1(capsys):
    assert cli.main(["inspect", RESNET, "--data-shape", "16"]) == 1
    assert "rejected the first batch" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-m", "keras_ipu_plugin", "inspect", RESNET, "--data-shape", "16,16,3"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "keras_ipu_plugin report" in result.stdout
    assert "Total params" in result.stdout


_TOKEN_MODEL = '''
import keras


class Tokens(keras.Model):
    def __init__(self):
        super().__init__()
        self.embed = keras.layers.Embedding(10, 4)
        self.head = keras.layers.Dense(2)

    def call(self, ids):
        return self.head(keras.ops.mean(self.embed(ids), axis=1))


def helper():
    return None
'''


def test_a_name_the_file_lacks_lists_what_it_defines(tmp_path, capsys):
    (tmp_path / "tokens.py").write_text(_TOKEN_MODEL)
    assert cli.main(["inspect", f"{tmp_path / 'tokens.py'}:Token", "--data-shape", "5"]) == 2
    assert "has no `Token`; it defines Tokens, helper." in capsys.readouterr().err


def test_an_input_an_embedding_reads_is_drawn_as_ids_without_dtype(tmp_path, capsys):
    """Without --dtype the inputs are float32; random floats as ids would
    convert a model fed values no tokenizer makes."""
    (tmp_path / "tokens.py").write_text(_TOKEN_MODEL)
    assert cli.main(["inspect", f"{tmp_path / 'tokens.py'}:Tokens", "--data-shape", "5"]) == 0
    out = capsys.readouterr().out
    assert "inputs an Embedding reads are drawn as int32 ids" in out
    assert "int32" in out.split("inputs:", 1)[1].splitlines()[0]
