"""MultiWorkerMirroredStrategy with two local processes on 127.0.0.1."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest
import tensorflow as tf

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "multi_worker.py"


#: Each multi-process test starts two TensorFlow workers: under pytest-xdist
#: they run on one pytest worker, one launch at a time (four workers at once
#: on two cores would crowd the launch's time limit).
multi_process = pytest.mark.xdist_group("multi_worker")


def _example():
    spec = importlib.util.spec_from_file_location("multi_worker_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@multi_process
@pytest.mark.parametrize("entry", ["plugin_model", "callback"])
def test_two_workers_train_like_one_process(tmp_path, entry):
    example = _example()
    # `launch` kills both workers on failure or after the time limit.
    example.launch(str(tmp_path), workers=2, timeout=300, entry=entry)
    results = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(2)]
    assert (tmp_path / "chief.weights.h5").exists()
    for mine, theirs in zip(results[0]["weights"], results[1]["weights"]):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))

    losses, single = example.train(tf.distribute.get_strategy(), entry=entry)
    for expected, actual in zip(single.get_weights(), results[0]["weights"]):
        np.testing.assert_allclose(np.array(actual), expected, atol=1e-4)
    np.testing.assert_allclose(results[0]["loss"], losses, atol=1e-4)


def _processes_mentioning(text):
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(cmdline.parent.name)
        except OSError:
            pass
    return found


@multi_process
def test_launch_cleans_up_failed_workers(tmp_path, monkeypatch):
    example = _example()
    monkeypatch.setattr(example, "__file__", str(tmp_path / "missing_script.py"))
    with pytest.raises(RuntimeError, match="worker failed"):
        example.launch(str(tmp_path), workers=2, timeout=60)


@multi_process
def test_launch_kills_workers_past_the_time_limit(tmp_path):
    example = _example()
    with pytest.raises(Exception, match="timed out|Timeout"):
        example.launch(str(tmp_path), workers=2, timeout=1)
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow
@multi_process
def test_scope_refuses_multi_worker_strategy_with_a_clear_error(tmp_path):
    example = _example()
    outputs = example.launch(str(tmp_path), workers=2, timeout=180, entry="scope_error")
    for output in outputs:
        assert "kip.scope refused" in output and "kip.PluginModel" in output
