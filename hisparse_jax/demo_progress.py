"""`hisparse demo`'s progress on stderr while a policy runs: a tqdm bar on a terminal, plain lines otherwise, and a
line whenever a step compiles (`Progress`, an `Engine.run(progress=...)` callback)."""

from __future__ import annotations

import os
import sys
import threading
import time

from tqdm import tqdm

from hisparse_jax.engine.runner import TRACE_COUNTS

_PLAIN_EVERY_S = 5.0  # a plain progress line at least this often when stderr is not a terminal


def _traces() -> tuple[int, int]:
    """(decode-step traces, whole-prompt prefill traces) so far: each new one is a compile under way."""
    return TRACE_COUNTS["store_decode_step"], TRACE_COUNTS["prefill"]


def _terminal(stream) -> bool:
    """Whether `stream` is a terminal a bar can be drawn on (a pseudo-terminal of width 0, as some runners give,
    would show tqdm's bar as nothing at all: it gets plain lines too)."""
    try:
        if not stream.isatty():
            return False
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no isatty / fileno (a StringIO), or a closed or odd stream
        return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """One policy's progress on stderr, as `Engine.run(progress=...)`: a tqdm bar (requests finished, with the
    step, running and waiting as postfix) when stderr is a terminal, else a plain line (no carriage return) at
    start, every `_PLAIN_EVERY_S` seconds and at the end. A watcher thread keeps a long step from being silent:
    it sees a compile start (the trace counters move mid-step) and says so; after a step that compiled, a line
    names its batch bucket (and indexer span, where the engine reports one) and how long the step took.
    `close()` stops the thread and ends the bar (or says done)."""

    def __init__(self, pol: str, n_requests: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.pol, self.n = pol, n_requests
        self.t0 = self.step_t0 = self.last_line = time.perf_counter()
        self.step, self.finished, self.running, self.waiting = 0, 0, 0, n_requests
        self.traces0, self.compiling = _traces(), ""
        self.lock = threading.Lock()
        self.bar = None
        if _terminal(self.stream):
            self.bar = tqdm(total=n_requests, desc=pol, unit="req", file=self.stream, dynamic_ncols=True,
                            mininterval=0.5, leave=True)
            self.bar.set_postfix({"step": 0, "running": 0, "waiting": n_requests})
        else:
            self._line(f"{pol}: starting {n_requests} requests")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"hisparse-demo-progress-{pol}", daemon=True)
        self._thread.start()

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)
        self.last_line = time.perf_counter()

    def _state(self) -> str:
        return (f"{self.pol}: step {self.step}, {self.finished}/{self.n} finished, {self.running} running, "
                f"{self.waiting} waiting, {time.perf_counter() - self.t0:.1f} s")

    def __call__(self, engine) -> None:
        m = engine.history[-1]
        with self.lock:
            now = time.perf_counter()
            self.step, self.running, self.waiting = engine.step_count, m.running, m.waiting
            self.finished = sum(r.finished for r in engine.requests.values())
            if m.compiled:
                span = f", indexer span {m.scored_pages} pages" if m.scored_pages else ""
                self._line(f"{self.pol}: step {m.step}: compiling the decode step for batch bucket {m.bucket}"
                           f"{span} (the step took {m.step_time_s:.1f} s)")
            elif self.compiling:  # a whole-prompt prefill compiled
                self._line(f"{self.pol}: step {m.step}: {self.compiling} (the step took "
                           f"{now - self.step_t0:.1f} s)")
            if self.bar is not None:
                self.bar.set_description_str(self.pol, refresh=False)
                self.bar.set_postfix({"step": self.step, "running": self.running, "waiting": self.waiting},
                                     refresh=False)
                self.bar.update(self.finished - self.bar.n)
            elif now - self.last_line >= _PLAIN_EVERY_S:
                self._line(self._state())
            self.step_t0, self.traces0, self.compiling = now, _traces(), ""

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            with self.lock:
                now = time.perf_counter()
                decode, prefill = (a - b for a, b in zip(_traces(), self.traces0))
                if (decode or prefill) and not self.compiling:
                    self.compiling = ("compiling the decode step for a new step shape" if decode else
                                      "compiling the whole-prompt prefill for a new prompt length bucket")
                    if self.bar is not None:
                        self.bar.set_description_str(f"{self.pol} ({self.compiling})")
                    else:
                        self._line(f"{self.pol}: step {self.step}: {self.compiling}...")
                if self.bar is not None:
                    self.bar.refresh()  # the elapsed time moves during a long step
                elif now - self.last_line >= _PLAIN_EVERY_S:
                    busy = now - self.step_t0
                    self._line(self._state() + (f" (step {self.step} running for {busy:.1f} s"
                                                + (f": {self.compiling})" if self.compiling else ")")
                                                if busy >= _PLAIN_EVERY_S else ""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self.lock:
            if self.bar is not None:
                self.bar.set_description_str(self.pol, refresh=False)
                self.bar.close()
            else:
                self._line(f"{self.pol}: done: {self.step} steps, {self.finished}/{self.n} finished, "
                           f"{time.perf_counter() - self.t0:.1f} s")
