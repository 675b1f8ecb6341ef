"""The pipeline benchmark's bubble column is the idle fraction it defines,
1 - T(1) / (S * T(M)) (benchmarks/pipeline_throughput.py): it printed
1 - 1 / (S * speedup), which is right only at M = 1."""

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def pipeline_throughput():
    return load_benchmark("pipeline_throughput")


def test_the_bubble_is_the_idle_fraction_of_the_stages(pipeline_throughput):
    bubble = pipeline_throughput.measured_bubble
    assert bubble(1.0, stages=2) == pytest.approx(0.5)  # one stage at a time
    assert bubble(2.0, stages=2) == pytest.approx(0.0)  # both busy all the time
    # GPipe's ideal step at M = 4, S = 2 (speedup 2 * 4 / 5) has GPipe's bubble.
    assert bubble(1.6, stages=2) == pytest.approx((2 - 1) / (4 + 2 - 1))


def test_the_report_prints_that_bubble(pipeline_throughput, capsys):
    one = [{"step_s": 0.6, "cpu_s": 0.7}] * 3
    four = [{"step_s": 0.4, "cpu_s": 0.7}] * 3  # 1.5x M = 1
    timing = {"results": [[(1, "gpipe"), one], [(4, "gpipe"), four]],
              "devices": ["/cpu:0", "/cpu:1"], "loads": [1.0, 1.0, 1.0]}
    pipeline_throughput.report("mlp", timing, {}, "workers", False, 4, 128)
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.startswith("gpipe") and line.split()[1] == "4")
    speedup, ideal, bubble, bound = (float(field) for field in row.split()[4:8])
    assert (speedup, ideal, bound) == (1.5, 1.6, 0.2)
    assert bubble == pytest.approx(0.25)


def _timing(keras_step):
    one = [{"step_s": 0.6, "cpu_s": 0.7}] * 3
    four = [{"step_s": 0.4, "cpu_s": 0.7}] * 3
    return {"results": [[(1, "gpipe"), one], [(4, "gpipe"), four], [(4, "1f1b"), four]],
            "devices": ["/cpu:0", "/cpu:1"], "loads": [1.0] * 3,
            "keras": [{"step_s": keras_step, "cpu_s": 0.6}] * 3}


def _peer_rows(capsys):
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("peers"))
    return lines[start:]


def test_the_report_sets_the_pipeline_against_keras_alone_and_data_parallelism(
        pipeline_throughput, capsys):
    peers = {"keras": [{"step_s": 0.5, "cpu_s": 0.6}] * 3,
             "mirrored": [{"step_s": 0.25, "cpu_s": 0.6}] * 3}
    pipeline_throughput.report("mlp", _timing(0.62), {}, "workers", False, 4, 128, peers)
    rows = _peer_rows(capsys)
    ratios = {line.split("  ")[1].strip(): float(line.split()[-1]) for line in rows
              if line.startswith("  ") and not line.startswith("    ")}
    assert ratios["Keras alone, one device of the same proxy"] == 1.0
    assert ratios["kip pipeline, 2 devices, M=1"] == pytest.approx(0.62 / 0.6, abs=0.005)
    assert ratios["kip pipeline, 2 devices, M=4, gpipe"] == pytest.approx(0.62 / 0.4, abs=0.005)
    # MirroredStrategy's ratio is against Keras alone in its own process.
    assert ratios["MirroredStrategy (data parallel), 2 devices"] == 2.0
    assert rows[-1] == ("fastest on two devices: MirroredStrategy, 0.250 s a step "
                        "(1.60x the throughput of the pipeline's M=4 1f1b)")


def test_the_fastest_pipeline_is_its_fastest_configuration_of_any_count(
        pipeline_throughput, capsys):
    timing = _timing(0.62)
    timing["results"].append([(8, "gpipe"), [{"step_s": 0.3, "cpu_s": 0.7}] * 3])
    peers = {"keras": [{"step_s": 0.5, "cpu_s": 0.6}] * 3,
             "mirrored": [{"step_s": 0.33, "cpu_s": 0.6}] * 3}
    pipeline_throughput.report("mlp", timing, {}, "workers", False, 4, 128, peers)
    rows = _peer_rows(capsys)
    assert not any("M=8" in row for row in rows[:-1])  # the table shows M = 1 and 4
    assert rows[-1] == ("fastest on two devices: the pipeline's M=8 gpipe, 0.300 s a step "
                        "(1.10x the throughput of MirroredStrategy)")


def test_the_report_names_the_pipeline_where_it_is_the_fastest(pipeline_throughput, capsys):
    peers = {"keras": [{"step_s": 0.5, "cpu_s": 0.6}] * 3,
             "mirrored": [{"step_s": 0.48, "cpu_s": 0.6}] * 3}
    pipeline_throughput.report("mlp", _timing(0.62), {}, "workers", False, 4, 128, peers)
    assert _peer_rows(capsys)[-1] == ("fastest on two devices: the pipeline's M=4 1f1b, 0.400 s "
                                      "a step (1.20x the throughput of MirroredStrategy)")
