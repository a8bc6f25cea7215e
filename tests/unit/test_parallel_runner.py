"""`tests/parallel.py`, the runner `make test` uses: on a small generated suite, every selected test runs exactly
once, each file whole in one worker with its module fixture built and torn down once (a session fixture once per
worker), the work is shared, and the exit status says what pytest's would (a failure anywhere fails the run; an
empty selection is exit 5)."""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest

from parallel import QUEUE_ENV, add_up, exit_status

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = """
import os
import pytest
import parallel
pytest_addoption, pytest_deselected = parallel.pytest_addoption, parallel.pytest_deselected
pytest_runtestloop, pytest_terminal_summary = parallel.pytest_runtestloop, parallel.pytest_terminal_summary

@pytest.fixture(scope="session")
def shared():
    with open(os.environ["RUNNER_LOG"], "a") as f:
        f.write(f"{os.getpid()} session setup\\n")
"""

TEST_FILE = """
import os, time
import pytest

LOG = os.environ["RUNNER_LOG"]

def log(what):
    with open(LOG, "a") as f:
        f.write(f"{{os.getpid()}} {{__name__}} {{what}}\\n")

def workers():
    return {{line.split()[0] for line in open(LOG) if line.endswith(" session setup\\n")}}

@pytest.fixture(scope="module")
def built():
    log("setup")
    deadline = time.time() + 120  # each file waits for every worker to be running one: all of them take part
    while time.time() < deadline and len(workers()) < int(os.environ["RUNNER_WORKERS"]):
        time.sleep(0.05)
    yield
    log("teardown")

@pytest.mark.parametrize("i", range({n}))
def test_it(shared, built, i):
    time.sleep(0.05)
    log(f"test {{i}}")
    assert not ({fail} and i == 1)
"""


def run(tmp_path, *args, files=6, fail=(), workers=2):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for k in range(files):
        (suite / f"test_f{k}.py").write_text(TEST_FILE.format(n=3 + k % 3, fail=k in fail))
    log = tmp_path / "log"
    log.touch()
    # as under `make test`: inside a worker of an outer run, whose queue the runner must leave alone
    outer = tmp_path / "outer-queue"
    outer.mkdir()
    env = {**os.environ, "RUNNER_LOG": str(log), "RUNNER_WORKERS": str(workers), "PYTHONPATH": TESTS,
           QUEUE_ENV: str(outer)}
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "parallel.py"), *args, "-q", "-p", "no:cacheprovider",
                           str(suite)], env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    events = [line.split() for line in log.read_text().splitlines()]
    assert not os.listdir(outer), f"the runner claimed {os.listdir(outer)} in the outer run's queue"
    return proc, events


def test_every_test_once_each_file_whole_in_one_worker(tmp_path):
    proc, events = run(tmp_path, "-j", "2")
    assert proc.returncode == 0, proc.stdout
    tests = collections.Counter((e[1], e[3]) for e in events if e[2] == "test")
    assert len(tests) == sum(3 + k % 3 for k in range(6)) and set(tests.values()) == {1}
    by_file = collections.defaultdict(list)
    for pid, module, *what in events:
        by_file[module].append((pid, " ".join(what)))
    assert len(by_file) == 7 and len(by_file.pop("session")) == 2  # once per worker: kept across its files
    for module, seen in by_file.items():
        assert len({pid for pid, _ in seen}) == 1, (module, seen)  # the whole file in one worker
        assert [w for _, w in seen if not w.startswith("test")] == ["setup", "teardown"]  # its fixture once
    assert len({e[0] for e in events}) == 2  # both workers ran files
    assert "[w1] " in proc.stdout and "[w2] " in proc.stdout
    assert f"2 workers: {len(tests)} passed (exits [0, 0]) -> exit 0" in proc.stdout


def test_one_worker_is_plain_pytest(tmp_path):
    proc, events = run(tmp_path, "-j", "1", files=2, workers=1)
    assert proc.returncode == 0 and "[w1]" not in proc.stdout
    assert len({e[0] for e in events}) == 1 and sum(e[2] == "test" for e in events) == 7


def test_a_failure_fails_the_run_and_the_rest_still_runs(tmp_path):
    proc, events = run(tmp_path, "-j", "2", fail=(2,))
    assert proc.returncode == 1, proc.stdout
    assert sum(e[2] == "test" for e in events) == sum(3 + k % 3 for k in range(6))
    final = next(line for line in proc.stdout.splitlines() if line.startswith("=== 2 workers: "))
    assert sorted(final.removeprefix("=== 2 workers: ").split(" (exits")[0].split(", ")) == ["1 failed", "23 passed"]


def test_an_empty_selection_is_exit_5(tmp_path):
    proc, _ = run(tmp_path, "-j", "2", "-k", "no_such_test")
    assert proc.returncode == 5, proc.stdout


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_list_deselected_once(tmp_path, jobs):
    """--list-deselected ends the run with the tests -k / -m left out, listed once (by one worker)."""
    proc, events = run(tmp_path, "-j", jobs, "--list-deselected", "-k", "not test_f1.py and not it[2]", files=3,
                       workers=int(jobs))
    assert proc.returncode == 0, proc.stdout
    lines = [line.removeprefix("[w1] ").removeprefix("[w2] ") for line in proc.stdout.splitlines()]
    heads = [i for i, line in enumerate(lines) if line.startswith("=") and " 6 deselected =" in line]
    assert len(heads) == 1, proc.stdout
    listed = {line.split("/")[-1] for line in lines[heads[0] + 1:heads[0] + 7]}
    assert listed == {"test_f0.py::test_it[2]", "test_f2.py::test_it[2]"} | {f"test_f1.py::test_it[{i}]"
                                                                            for i in range(4)}, proc.stdout
    assert sum(e[2] == "test" for e in events) == 3 + 4 + 5 - 6


def test_summaries_add_up():
    assert add_up(["769 passed, 115 skipped, 13 deselected, 1 warning", "425 passed, 1 failed, 13 deselected"]) \
        == "1194 passed, 115 skipped, 13 deselected, 1 warning, 1 failed"
    assert add_up(["3 passed, 1 warning, 1 error", "2 passed, 2 warnings, 1 error"]) \
        == "5 passed, 3 warnings, 2 errors"


@pytest.mark.parametrize("codes, status", [([0, 0], 0), ([0, 5], 0), ([5, 5], 5), ([5, 1], 1), ([2, 1], 2)])
def test_exit_status(codes, status):
    assert exit_status(codes) == status
