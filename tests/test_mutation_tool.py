"""`tools/mutation.py` tests what it says: every mutation still applies to
the code (its snippet occurs exactly once in its file), and one that does
not fails the tool instead of passing it. No mutation is run here."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutation_tool():
    spec = importlib.util.spec_from_file_location("kip_mutation_tool", ROOT / "tools" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutation_applies_to_exactly_one_place_of_the_code():
    tool = _mutation_tool()
    problems = {m.name: status for m in tool.MUTATIONS
                for _, status in [tool.locate(m, ROOT)] if status}
    assert problems == {}, f"stale or ambiguous mutations (update them): {problems}"
    for mutation in tool.MUTATIONS:
        for test in mutation.tests:
            assert (ROOT / test).is_file(), (mutation.name, test)
    names = [m.name for m in tool.MUTATIONS]
    assert len(names) == len(set(names))


def test_the_mutation_tool_check_fails_naming_a_stale_mutation(capsys):
    tool = _mutation_tool()
    stale = tool.Mutation("gone", "frontend/verify/equivalence.py", "no such snippet #$%", "", "stale", ())
    assert tool.check([stale], ROOT) == 1
    assert "gone" in capsys.readouterr().out
    assert tool.check(tool.MUTATIONS, ROOT) == 0


def test_a_run_with_a_stale_mutation_fails_before_running_any_test(monkeypatch, capsys):
    tool = _mutation_tool()
    stale = tool.Mutation("gone", "frontend/verify/equivalence.py", "no such snippet #$%", "", "stale", ())
    monkeypatch.setattr(tool, "MUTATIONS", [stale, *tool.MUTATIONS[:1]])
    ran = []
    monkeypatch.setattr(tool, "mutate_and_test", lambda *args: ran.append(args))
    assert tool.main([]) == 1
    assert ran == []
    assert "gone" in capsys.readouterr().out
    assert tool.main(["--list"]) == 1  # listing says so too
    monkeypatch.setattr(tool, "MUTATIONS", tool.MUTATIONS[1:])
    assert tool.main(["--check"]) == 0
