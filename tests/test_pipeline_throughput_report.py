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
