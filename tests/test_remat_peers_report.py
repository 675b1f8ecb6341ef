"""The remat peers benchmark's verdict compares the clock it is asked to:
wall-clock step time or the process's CPU time (benchmarks/remat_peers.py)."""

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def remat_peers():
    return load_benchmark("remat_peers")


def _results():
    # kip-auto is slower than the best peer by wall-clock (a loaded round),
    # faster by CPU time.
    mib = 2 ** 20
    return {
        "none": {"step_peak": 100 * mib, "step_s": 1.0, "step_cpu_s": 1.0, "plan": None},
        "kip-hand": {"step_peak": 30 * mib, "step_s": 1.2, "step_cpu_s": 1.25, "plan": None},
        "kip-auto": {"step_peak": 25 * mib, "step_s": 1.3, "step_cpu_s": 1.2,
                     "plan": {"peak": 20 * mib}},
    }


def test_the_verdict_uses_wall_clock_time_by_default(remat_peers, capsys):
    remat_peers.report("mlp", _results())
    out = capsys.readouterr().out
    assert "step time <= 1.05x its: NOT met (1.08x)" in out
    assert "wall-clock step time" in out


def test_the_verdict_uses_cpu_time_when_asked(remat_peers, capsys):
    remat_peers.report("mlp", _results(), clock="step_cpu_s")
    out = capsys.readouterr().out
    assert "step time <= 1.05x its: met (0.96x)" in out
    assert "step CPU time" in out


def test_rounds_are_summarised_by_their_medians(remat_peers):
    runs = [{"step_peak": p, "step_s": s, "step_cpu_s": c, "plan": None, "device": "CPU:0"}
            for p, s, c in ((3, 0.5, 0.4), (1, 2.0, 0.6), (2, 1.0, 0.5))]
    summary = remat_peers.summarise(runs + [{"error": "failed once"}])
    assert (summary["step_peak"], summary["step_s"], summary["step_cpu_s"]) == (2, 1.0, 0.5)
    assert summary["rounds"] == 3


def test_a_peer_holding_more_than_no_recomputation_is_not_the_best_peer(remat_peers, capsys):
    """`RematScope("activations")` on the gallery model held 1.10x none at
    1.10x its time: the only Keras mode within the time limit, but beaten by
    doing nothing. The best peer is then the least-holding plan that saves
    memory, whatever its time."""
    mib = 2 ** 20
    results = {
        "none": {"step_peak": 100 * mib, "step_s": 1.0, "step_cpu_s": 1.0, "plan": None},
        "keras-activations": {"step_peak": 110 * mib, "step_s": 1.1, "step_cpu_s": 1.1,
                              "plan": None},
        "kip-hand": {"step_peak": 40 * mib, "step_s": 1.4, "step_cpu_s": 1.4, "plan": None},
        "kip-auto": {"step_peak": 35 * mib, "step_s": 1.3, "step_cpu_s": 1.3, "plan": None},
    }
    remat_peers.report("gallery", results)
    out = capsys.readouterr().out
    assert "none within 1.35x none's wall-clock step time: least step peak): kip-hand" in out
    assert "step time <= 1.05x its: met (0.93x)" in out
    assert "no peer holds as little as kip-auto at equal or lower step time" in out


def test_a_peer_holding_less_at_no_more_time_is_named(remat_peers, capsys):
    results = _results()
    results["kip-hand"] = {**results["kip-hand"], "step_peak": 20 * 2 ** 20}
    remat_peers.report("mlp", results)
    out = capsys.readouterr().out
    assert "step peak <= kip-hand's: NOT met" in out
    assert "holding as little as kip-auto at equal or lower step time: kip-hand" in out
