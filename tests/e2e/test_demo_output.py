"""What `hisparse demo` shows a newcomer: the workload and budgets before any work, a steps row, the CPU caveat and
why preempt shows no preemptions under the table, progress on stderr (plain lines, no carriage returns, when
stderr is not a terminal; a tqdm bar when it is; a line whenever a step compiles), and a plot whose overlapping
series stay apart."""

from __future__ import annotations

import io
import re
import time
import types

import pytest

from hisparse_jax import demo, demo_progress, demo_report
from hisparse_jax.engine.runner import TRACE_COUNTS
from hisparse_jax.results import StepMetrics


@pytest.mark.slow
def test_demo_prints_header_steps_caveat_and_why_preempt_does_not_preempt(capsys, monkeypatch):
    seen = {}
    table = demo_report.table

    def keep(out):
        seen["out"] = out
        return table(out)

    monkeypatch.setattr(demo, "table", keep)
    assert demo.main(["--requests", "2", "--prompt-len", "64", "--new-tokens", "2", "--plot", ""]) == 0
    cap = capsys.readouterr()
    out, lines = seen["out"], cap.out.splitlines()
    lens = out["prompt_tokens"]
    # the header, before the table
    assert lines[0] == (f"workload: 2 requests, prompts {min(lens)}..{max(lens)} tokens, 2 new tokens each, "
                        "kv float32, model stdlib-dsa, text prompts (prefill whole, kernels reference, "
                        "backend cpu)"), lines[0]
    assert lines[1].startswith(f"budgets: device {out['device_budget_bytes']:,} bytes"), lines[1]
    assert "3.5 longest requests' KV + indexer keys" in lines[1] and f"host pool {out['host_pages']} pages" in lines[1]
    assert lines[2].split() == ["preempt", "offload", "hisparse"]
    pols = out["policies"]
    for line, name, key in zip(lines[3:6], ("device KV pages", "indexer pages", "host pages"),
                               ("device_pages", "index_pages", "host_pages")):
        assert line.startswith(name) and line[len(name):].split() == [str(pols[p][key]) for p in pols], line
    # one capacity holds every policy's budget (the largest pools), so offload and hisparse share their programs
    capacity = out["capacity"]
    assert capacity["device_pages"] == max(p["device_pages"] for p in pols.values())
    assert capacity["index_pages"] == max(p["index_pages"] for p in pols.values())
    assert lines[6].startswith(f"(the store is shaped by one capacity holding every budget, "
                               f"{capacity['device_pages']} device KV / {capacity['index_pages']} indexer pages"), lines[6]
    assert lines.index(next(x for x in lines if x.startswith("mean running"))) > 7
    # the steps row, the caveat, the explanation of zero preemptions
    steps = next(x for x in lines if x.startswith("steps "))
    assert steps.split()[1:] == [str(pols[p]["steps"]) for p in pols], steps
    assert any(x.startswith("note: tokens/s and wall s are CPU figures and do not reflect GPU memory-bound decode")
               for x in lines), cap.out
    why = [x for x in lines if x.startswith("preempt shows 0 preemptions")]
    if pols["preempt"]["preemptions"] == 0:
        assert len(why) == 1 and "admission 'vllm' admits on the prompt's pages" in why[0], cap.out
    else:
        assert not why, cap.out
    # progress: plain lines on a stderr that is not a terminal, each compile said
    assert "\r" not in cap.err and "\r" not in cap.out
    for pol in pols:
        assert f"{pol}: starting 2 requests" in cap.err and f"{pol}: done: {pols[pol]['steps']} steps, 2/2 finished" \
            in cap.err, cap.err
    assert re.search(r"preempt: step \d+: compiling the decode step for batch bucket 8\b.*\(the step took [\d.]+ s\)",
                     cap.err), cap.err


def _engine(step: int, running: int, waiting: int, finished: int, n: int, compiled=False, bucket=8):
    reqs = {f"r{i}": types.SimpleNamespace(finished=i < finished) for i in range(n)}
    fields = {f: 0 for f in StepMetrics.__dataclass_fields__}
    fields.update(step=step - 1, running=running, waiting=waiting, compiled=compiled, bucket=bucket, step_time_s=0.1,
                  wait_reasons={})
    hist = [StepMetrics(**fields)]
    return types.SimpleNamespace(history=hist, step_count=step, requests=reqs)


def test_plain_progress_lines_and_compile_notice_without_a_terminal(monkeypatch):
    monkeypatch.setattr(demo_progress, "_PLAIN_EVERY_S", 0.3)
    monkeypatch.setitem(TRACE_COUNTS, "store_decode_step", TRACE_COUNTS["store_decode_step"])
    err = io.StringIO()
    p = demo_progress.Progress("offload", 4, stream=err)
    try:
        TRACE_COUNTS["store_decode_step"] += 1  # a step starts compiling
        time.sleep(0.7)
        p(_engine(1, 3, 1, 0, 4, compiled=True, bucket=16))
        time.sleep(0.7)  # a quiet stretch: still a line every _PLAIN_EVERY_S
        p(_engine(2, 2, 0, 2, 4))
    finally:
        p.close()
    text = err.getvalue()
    assert "\r" not in text
    assert "offload: step 0: compiling the decode step for a new step shape..." in text, text
    assert "offload: step 0: compiling the decode step for batch bucket 16 (the step took 0.1 s)" in text, text
    assert re.search(r"offload: step 1, 0/4 finished, 3 running, 1 waiting", text), text
    assert text.splitlines()[0] == "offload: starting 4 requests" and "offload: done: 2 steps, 2/4 finished" in text


def test_progress_is_a_tqdm_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    err = Terminal()
    p = demo_progress.Progress("hisparse", 4, stream=err)
    try:
        p(_engine(3, 4, 0, 1, 4))
    finally:
        p.close()
    text = err.getvalue()
    assert "\r" in text and "hisparse" in text and "req" in text, text
    assert "running=4" in text and "waiting=0" in text and "1/4" in text, text


def test_plot_keeps_overlapping_series_apart(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    same = [0, 2, 4, 4, 4, 4, 3, 2, 1, 0] * 4  # preempt and offload coincide step for step
    results = {"preempt": {"running_over_time": same, "mean_running": 2.4},
               "offload": {"running_over_time": list(same), "mean_running": 2.4},
               "hisparse": {"running_over_time": [min(v * 3, 16) for v in same], "mean_running": 6.9}}
    path = str(tmp_path / "running.png")
    assert demo_report.plot(results, path) == path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    fig = demo_report.figure(results)
    try:
        lines = fig.axes[0].get_lines()
        assert [ln.get_label().split()[0] for ln in lines] == list(results)
        for attr in ("get_linestyle", "get_marker", "get_zorder", "get_markevery"):
            values = [getattr(ln, attr)() for ln in lines]
            assert len(set(map(str, values))) == 3, (attr, values)
        assert all(ln.get_alpha() is not None and ln.get_alpha() < 1 for ln in lines)
    finally:
        plt.close(fig)
