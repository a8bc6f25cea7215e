"""The README's and the docs pages' Python snippets run as written, as a reader pastes them: the README's ```python
blocks in order in one namespace, and each docs/*.md page's blocks in order in a namespace of its own (a page builds
only on its own earlier blocks). Relative links between them must point at files and headings that exist."""

from __future__ import annotations

import ast
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [os.path.join(ROOT, "README.md")] + DOCS


def _blocks(path: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", open(path).read(), re.S | re.M)


def _run_page(path: str, tmp_path) -> dict:
    """Run a page's ```python blocks in order in one fresh namespace; return it."""
    name = os.path.relpath(path, ROOT)
    ns: dict = {"__name__": "snippets"}
    for i, code in enumerate(_blocks(path)):
        code = code.replace("/tmp/", f"{tmp_path}/")  # the snippets write to /tmp: keep the test's files its own
        exec(compile(code, f"{name} python block {i + 1}", "exec"), ns)
    return ns


# The snippets are end-to-end uses of the same device programs the unmarked tests prove on both ends of the jax
# range: `slow`, so CI runs them on its first leg (the plain `make test` runs them everywhere)
@pytest.mark.slow
def test_readme_python_snippets_run(tmp_path, monkeypatch):
    readme = os.path.join(ROOT, "README.md")
    assert len(_blocks(readme)) >= 2
    monkeypatch.chdir(tmp_path)
    ns = _run_page(readme, tmp_path)
    assert ns["outputs"] == ns["tokens"]  # the engine's example: the same tokens as generate
    shown = _shown_values(readme)
    assert shown, "the README shows its tiered example's hits, misses and mean running"
    for expr, value in shown:  # what the README says an expression gives, it gives
        assert eval(expr, ns) == ast.literal_eval(value), (expr, value)


def _shown_values(path: str) -> list[tuple[str, str]]:
    """The lines of a page's ```python blocks that are a bare expression followed by the value it gives as a
    comment, e.g. `stats.hits, stats.misses   # (39222, 3962)`: [(expression, value)]."""
    return [(m.group(1), m.group(2)) for block in _blocks(path) for line in block.splitlines()
            if (m := re.fullmatch(r"([^=#]+?)\s+#\s*(\(.*\))", line))]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in DOCS if _blocks(p)], ids=lambda p: os.path.basename(p))
def test_docs_python_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run_page(page, tmp_path)


def _anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to hyphens)."""
    text = re.sub(r"^```.*?^```", "", open(path).read(), flags=re.S | re.M)
    heads = re.findall(r"^#+ +(.+?) *$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_docs_exist_and_links_resolve():
    assert DOCS, "docs/*.md"
    readme = open(os.path.join(ROOT, "README.md")).read()
    for page in DOCS:  # every page is reachable from the README
        assert f"docs/{os.path.basename(page)}" in readme, f"README.md does not link {os.path.basename(page)}"
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", open(page).read(), flags=re.S | re.M)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
            where = f"{os.path.relpath(page, ROOT)} -> {target}"
            assert os.path.exists(dest), where
            if anchor:
                assert anchor in _anchors(dest), where
