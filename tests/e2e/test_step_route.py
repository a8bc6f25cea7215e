"""docs/architecture.md's route of one decode step stays true: `experiments/step_route.py` measures which files of
`hisparse_jax/` a HiSparse step (a decode row and a 64-token prompt chunk, traced afresh) runs; each is named on the
page, and the count issue 51 bounds (besides the model and the files read for sizes and types) stays <= 15."""

from __future__ import annotations

import os
import re

import pytest

from experiments import step_route

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.newest_leg  # CI: on the newest-jax leg (the shorter); it passes on both ends
def test_the_documented_route_is_the_measured_one():
    r = step_route.route()
    assert r["step"]["decode_tokens"] == 1 and r["step"]["prefill_tokens"] == 64 and r["step"]["compiled"], r["step"]
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        page = f.read()
    for name in r["files"]:  # kv/ and engine/ files by path; the model's by name in its item
        shown = name if not name.startswith("model/") else os.path.basename(name)
        assert re.search(rf"\b{re.escape(shown)}\b", page), f"{name} is not on the page"
    count = re.search(r"(\d+) files of `hisparse_jax/` run Python in this step", page)
    assert count and int(count.group(1)) == len(r["files"]), (count and count.group(1), len(r["files"]))
    remain = re.search(r"(\d+) remain", page)
    assert remain and int(remain.group(1)) == len(r["counted"]) <= 15, (remain and remain.group(1), r["counted"])
