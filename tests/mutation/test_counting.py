"""How scripts/mutants.sh counts (run.py, catches.py), without a mutant: a failure is a catch only where it is an
assertion in the mutant's selection; a crash is reported apart, and makes the exit status 1, as a catch outside
the selection does."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import catches  # noqa: E402
from mutants import Mutant  # noqa: E402
from run import judged, to_look_at  # noqa: E402

pytest_plugins = ["pytester"]

SELECTION = "test_every_call_of_the_ops and sum"
IN, OUT = "tests/properties/test_op_properties.py::test_every_call_of_the_ops[x-sum]", "tests/x.py::test_other"


def mutant(**kwargs):
    return Mutant("a-bug", (("fairseq_fwp/x.py", "a", "b"),), "a bug", **kwargs)


def crash(test=IN, selected=True):
    return catches.record(test, "call", "RuntimeError", False, selected, "The size of tensor a (2) must match ...")


def assertion(test=IN, selected=True):
    return catches.record(test, "call", "AssertionError", True, selected, "outputs: 0.3 off")


def test_a_crash_is_reported_apart_and_fails_the_run():
    r = judged(mutant(harness=SELECTION), [("harness", [crash()], 1.0)], harness_only=True)
    assert (r["result"], r["type"], r["test"]) == ("crashed", "RuntimeError", IN)
    assert "missed it (it crashed: RuntimeError in " in r["notes"][0]
    assert to_look_at({"a-bug": r}) == ["a-bug"]
    r = judged(mutant(), [("harness", [crash()], 1.0), ("fast lane", [], 2.0)], harness_only=False)
    assert (r["result"], r["notes"], r["seconds"]) == ("crashed", [], 3.0)
    assert to_look_at({"a-bug": r}) == ["a-bug"]


def test_an_assertion_after_a_crash_catches_it():
    r = judged(mutant(harness=SELECTION), [("harness", [crash(), assertion()], 1.0)], harness_only=True)
    assert (r["result"], r["type"], r["notes"]) == ("harness", "AssertionError", [])
    assert to_look_at({"a-bug": r}) == []
    r = judged(mutant(), [("harness", [crash()], 1.0), ("fast lane", [crash(OUT), assertion(OUT)], 2.0)], False)
    assert (r["result"], r["test"], r["notes"]) == ("fast lane", OUT, [])


def test_a_catch_outside_the_selection_is_not_counted_and_fails_the_run():
    r = judged(mutant(harness=SELECTION), [("harness", [assertion(OUT, selected=False)], 1.0)], harness_only=True)
    assert (r["result"], r["test"]) == ("outside its selection", OUT)
    assert to_look_at({"a-bug": r}) == ["a-bug"]
    failures = [assertion(OUT, selected=False), crash(), assertion()]  # and one in it: caught
    assert judged(mutant(harness=SELECTION), [("harness", failures, 1.0)], harness_only=True)["result"] == "harness"


def test_nothing_failed():
    assert judged(mutant(), [("harness", [], 1.0)], harness_only=True)["result"] == "not caught"
    r = judged(mutant(), [("harness", [], 1.0), ("fast lane", [], 1.0)], harness_only=False)
    assert r["result"] == "survived" and to_look_at({"a-bug": r}) == ["a-bug"]
    r = judged(mutant(equivalent="the same function"), [("harness", [], 1.0), ("fast lane", [], 1.0)], False)
    assert (r["result"], r["message"]) == ("equivalent", "the same function") and to_look_at({"a-bug": r}) == []
    r = judged(mutant(equivalent="the same function"), [("harness", [crash()], 1.0)], harness_only=True)
    assert r["result"] == "crashed" and "a test crashed on it: its reason is wrong" in r["notes"][0]


def test_the_plugin_tells_assertions_from_crashes_and_stops_at_the_first_catch_in_the_selection(pytester, tmp_path):
    pytester.makepyfile(test_a="""
        import pytest
        from hypothesis import Phase, given, settings, strategies as st

        def test_crashes():
            [1, 2][5]

        def test_asserts_outside():
            assert 1 == 2

        @settings(derandomize=True, database=None, phases=[Phase.generate])
        @given(st.integers(0, 10))
        def test_selected_crash_in_an_example(x):
            if x > 0:
                raise RuntimeError("a shape error")

        def test_selected_fails():
            pytest.fail("DID NOT RAISE")

        def test_selected_asserts_too():
            assert False
    """, test_b="import no_such_module\n")
    records = tmp_path / "failures.jsonl"
    pytester.runpytest_inprocess("-p", "catches", f"--failures-to={records}", "--selection=selected",
                                 "--stop-at-catch", "--continue-on-collection-errors", "-p", "no:cacheprovider")
    got = [(r["test"].split("::")[-1], r["when"], r["type"], r["catch"], r["selected"]) for r in catches.read(records)]
    assert got == [("test_b.py", "collect", "collection error", False, True),
                   ("test_crashes", "call", "IndexError", False, False),
                   ("test_asserts_outside", "call", "AssertionError", True, False),
                   ("test_selected_crash_in_an_example", "call", "RuntimeError", False, True),
                   ("test_selected_fails", "call", "Failed", True, True)]  # and the run ended there
    assert "No module named 'no_such_module'" in catches.read(records)[0]["message"]
