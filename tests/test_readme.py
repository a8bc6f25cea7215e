"""The README's Python snippets run as written, in order, in one namespace (as a reader pastes them)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_python_snippets_run(tmp_path, monkeypatch):
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        code = code.replace("/tmp/", f"{tmp_path}/")  # the snippets write to /tmp: keep the test's files its own
        exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)
    assert ns["outputs"] == ns["tokens"]  # the engine's example: the same tokens as generate
