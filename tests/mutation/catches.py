"""Which failures of a pytest run against a mutant are catches: a pytest plugin (`-p catches`: copies.pytest_in
loads it) that writes each failure's test, phase and exception type, one JSON line each, and can end the run at
the first catch; and the reading of what it wrote.

A catch is a test's own check that fails: AssertionError (assert, torch.testing.assert_close, numpy.testing, a
message that pytest.raises does not match) or pytest's Failed (pytest.fail, pytest.raises' "DID NOT RAISE").
Any other exception is a crash, which says that the mutant broke something, not that a test checks what it
broke: a shape error, a module that does not import (a collection error), hypothesis's own errors (Unsatisfiable:
every example rejected; Flaky: a failure that does not replay), a run that died or hung (copies.pytest_in). A
property test fails with the exception of its first failing example: hypothesis raises that example's own, and
the profile "mutants" does not shrink, so its search stops there. A test that turns an exception into an
assertion of its own is a check, and counts (tests/helpers.read_in_one_call: the generator must generate where
fairseq's forcing, on the same input, does).

The run goes on past crashes and past catches outside --selection (a -k expression, matched as pytest's -k
matches it; every test where there is none), and with --stop-at-catch ends after the first catch in it: a crash
in one test does not hide an assertion of a later one, and a mutant that only crashes costs one run of the lane.
"""
import json

import pytest

CATCHES = (AssertionError, pytest.fail.Exception)


def record(test, when, kind, catch, selected, message):
    """One failure: the test's id (a module's for a collection error), its phase (setup, call, teardown; collect;
    run: the whole run's end), the exception's type, whether it is a catch, whether the selection holds the test,
    and the first line of the message."""
    return {"test": test, "when": when, "type": kind, "catch": catch, "selected": selected,
            "message": message.strip().split("\n", 1)[0][:300]}


def first(failures, catch, selected=None):
    """The first record of `failures` that is a catch (catch=True) or a crash (False), in the selection or outside
    it (selected=None: either), or None."""
    return next((r for r in failures if r["catch"] == catch and selected in (None, r["selected"])), None)


def read(path):
    """The records a run wrote, in the order its failures happened."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def said(failure):
    """A record in a few words: "RuntimeError in file::test"."""
    return f"{failure['type']} in {failure['test'].rsplit('/', 1)[-1]}"


# -- the plugin --

def pytest_addoption(parser):
    group = parser.getgroup("catches", "failures of a run against a mutant (tests/mutation/catches.py)")
    group.addoption("--failures-to", metavar="PATH", help="append each failure, one JSON line each, to PATH")
    group.addoption("--selection", metavar="EXPRESSION", help="the tests whose catches count (-k's syntax)")
    group.addoption("--stop-at-catch", action="store_true", help="end the run after the first catch in --selection")


def _write(config, failure):
    with open(config.getoption("failures_to"), "a") as f:
        f.write(json.dumps(failure) + "\n")


def _selected(item):
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    expression = item.config.getoption("selection")
    return not expression or Expression.compile(expression).evaluate(KeywordMatcher.from_item(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and item.config.getoption("failures_to"):
        error = call.excinfo
        catch = error is not None and issubclass(error.type, CATCHES)
        failure = record(report.nodeid, report.when, error.typename if error else "(no exception)", catch,
                         _selected(item), str(error.value) if error else "")
        _write(item.config, failure)
        if catch and failure["selected"] and item.config.getoption("stop_at_catch"):
            item.session.shouldfail = f"the first catch: {report.nodeid}"  # after this test's teardown
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if report.failed and collector.config.getoption("failures_to"):
        # the module's own error is only in the text pytest made of it: its last line, for the eye
        lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
        _write(collector.config, record(report.nodeid, "collect", "collection error", False, True,
                                        lines[-1].lstrip("E ") if lines else ""))
    return report
