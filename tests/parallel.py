"""The test suite in several pytest processes at once: `make test`'s runner.

    python tests/parallel.py [-j N] [pytest arguments...]

Starts N pytest processes (workers) with the same arguments. Each collects the whole selection, then runs test
files off one shared queue: before a file's first test a worker claims the file (an exclusive create in a
temporary directory both can see); a file another worker claimed is left to it. So every selected file runs
exactly once, whole, in one process (its module fixtures built once), files are taken in pytest's order, and a
worker that finishes a long file takes the next free one: the load balances itself, with no weights to keep.
Most of the suite's time is one Python thread tracing and XLA:CPU compiling. Measured on 2 cores (2026-12-06, six
e2e files, jax 0.10.2): one process 396 s, two workers 228 s, three 248 s; so `make test` runs two.

Every line a worker prints is prefixed with `[wK]`; a last line adds their summaries up. The exit status: the first
failing worker's (pytest's: 1 tests failed, 2 interrupted, 3 internal error, 4 usage), else 5 if no worker
collected a test (an empty run never passes), else 0. `-j 1` runs plain pytest, with no queue. Each worker keeps
its own compilation cache (the suite's, `conftest._share_compiled_programs`) unless JAX_COMPILATION_CACHE_DIR
names one: one cache shared by both workers saved nothing (four e2e files on jax 0.12.1: 217 s vs 210 s apart).

It is also the suite's pytest plugin (tests/conftest.py imports its hooks): the run loop over claimed files, and
`--list-deselected`, which ends the run with the tests -m / -k left out, listed by one worker (CI's legs list what
they leave to each other this way, from the collection the run makes anyway).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading

QUEUE_ENV = "HISPARSE_TEST_QUEUE"  # the claims directory a worker shares with the others (unset: plain pytest)
# pytest's last line: "12 passed, 3 skipped in 4.56s" (-q) or "==== ... in 4.56s (0:00:04) ===="
_SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)\b.*?) "
                      r"in [\d.]+s")


def _claim(queue: str, path: str) -> bool:
    """Whether this worker takes test file `path` (True exactly once among the workers sharing `queue`)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", path)
    try:
        os.close(os.open(os.path.join(queue, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def once(name: str) -> bool:
    """Whether this worker does `name`, which the run does once (True in exactly one of the workers sharing a queue;
    always True outside one)."""
    queue = os.environ.get(QUEUE_ENV)
    return not queue or _claim(queue, f"once {name}")


# ----- the pytest hooks (tests/conftest.py imports them) ----------------------------------------
def pytest_addoption(parser):
    parser.addoption("--list-deselected", action="store_true",
                     help="end with the node ids of the tests -m / -k deselected (CI: what a leg leaves to the other)")


_DESELECTED: list[str] = []


def pytest_deselected(items):
    _DESELECTED.extend(item.nodeid for item in items)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """--list-deselected: the deselected tests, once per run (under a queue, by one worker); not after a usage error
    or an interrupted run."""
    if config.getoption("list_deselected") and exitstatus in (0, 1, 5) and once("list deselected"):
        terminalreporter.section(f"{len(_DESELECTED)} deselected")
        for nodeid in _DESELECTED or ["(none)"]:
            terminalreporter.write_line(nodeid)


def pytest_runtestloop(session) -> bool | None:
    """pytest's run loop over the files this worker claims (None outside a queue: pytest's own loop runs). The
    next item a test is told of (for fixture teardown) is the next one this worker will run: the following file is
    claimed before the last test of the current one runs."""
    queue = os.environ.get(QUEUE_ENV)
    if not queue or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(f"{session.testsfailed} error(s) during collection")
    files: dict[str, list] = {}
    for item in session.items:  # in pytest's order, which may interleave files (parametrized session fixtures)
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    pending = iter(files)

    def next_claimed() -> list:
        return next((files[p] for p in pending if _claim(queue, p)), [])

    current = next_claimed()
    while current:
        following = []
        for i, item in enumerate(current):
            if i + 1 == len(current):
                following = next_claimed()
            nextitem = current[i + 1] if i + 1 < len(current) else (following[0] if following else None)
            item.config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
            if session.shouldfail:
                raise session.Failed(session.shouldfail)
            if session.shouldstop:
                raise session.Interrupted(session.shouldstop)
        current = following
    return True


def _copy_lines(proc: subprocess.Popen, prefix: str, lock: threading.Lock, summaries: list) -> None:
    for line in proc.stdout:
        if m := _SUMMARY.match(line.strip()):
            summaries.append(m.group(1))
        with lock:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def exit_status(codes: list[int]) -> int:
    """The runner's exit status from its workers' (see the module's docstring)."""
    if failed := [c for c in codes if c not in (0, 5)]:
        return failed[0]
    return 5 if all(c == 5 for c in codes) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # -h and the rest go to pytest
    parser.add_argument("-j", "--jobs", type=int, default=2, help="pytest processes (default 2; 1: plain pytest)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    command = [sys.executable, "-m", "pytest", *pytest_args]
    if args.jobs == 1:  # plain pytest, even inside a worker of another run (a test of this runner, say)
        return subprocess.call(command, env={k: v for k, v in os.environ.items() if k != QUEUE_ENV})
    lock, summaries, procs, threads = threading.Lock(), [], [], []
    with tempfile.TemporaryDirectory(prefix="hisparse-test-queue-") as queue:
        try:
            for k in range(1, args.jobs + 1):
                proc = subprocess.Popen(command, env={**os.environ, QUEUE_ENV: queue}, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, bufsize=1)
                procs.append(proc)
                threads.append(t := threading.Thread(target=_copy_lines, args=(proc, f"[w{k}] ", lock, summaries)))
                t.start()
            codes = [proc.wait() for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for t in threads:
                t.join()
    status = exit_status(codes)
    print(f"=== {args.jobs} workers: {add_up(summaries) or 'no summary'} (exits {codes}) -> exit {status} ===",
          flush=True)
    return status


def add_up(summaries: list[str]) -> str:
    """The workers' pytest summaries as one ("769 passed, 1 warning" + "425 passed" -> "1194 passed, 1 warning").
    Each worker deselects the same tests (they collect the same), so "deselected" is counted once."""
    totals: dict[str, int] = {}
    for summary in summaries:
        for n, word in re.findall(r"(\d+) (\w+)", summary):
            word = word.removesuffix("s") if word in ("warnings", "errors") else word
            totals[word] = max(totals.get(word, 0), int(n)) if word == "deselected" else totals.get(word, 0) + int(n)
    return ", ".join(f"{n} {word}{'s' if n != 1 and word in ('warning', 'error') else ''}"
                     for word, n in totals.items())


if __name__ == "__main__":
    sys.exit(main())
