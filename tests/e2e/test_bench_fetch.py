"""`experiments/bench_fetch.py` keeps running (tiny shapes, in process): every mechanism fetches the host rows
exactly, and its JSON reports what each moved and how many host computations / copies it made."""

from __future__ import annotations

import json

import pytest

from experiments import bench_fetch
from hisparse_jax.kv.resolve import fetch_sizes

# 128 top-k slots; the packed fetch's staging sizes 16, 32, 64, 128: the two fractions (12 and 76 misses) take
# different branches of its switch
ARGS = dict(requests=2, topk=64, layers=2, ctx=256, fracs=(0.1, 0.6), min_rows=16)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_fetch") / "bench_fetch.json"
    argv = [f"--{k.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, tuple) else v}"
            for k, v in ARGS.items()]
    assert bench_fetch.main(argv + ["--repeats=1", f"--out={out}"]) == 0
    return json.loads(out.read_text())


def test_every_mechanism_fetches_the_host_rows(res):
    checks = res["equal_rows"]
    assert {(c["kv_dtype"], c["mechanism"]) for c in checks} == {
        (kv, m) for kv in ("fp8", "bf16") for m in bench_fetch.MECHANISMS}
    assert all(c["equal_to_host_rows"] for c in checks), [c for c in checks if not c["equal_to_host_rows"]]


def test_bytes_and_operations_per_mechanism(res):
    B, K, L = ARGS["requests"], ARGS["topk"], ARGS["layers"]
    sizes = fetch_sizes(ARGS["min_rows"], B * K)
    assert sizes == (16, 32, 64, 128)
    rows = res["fetch"]
    assert {(r["kv_dtype"], r["frac"], r["mechanism"]) for r in rows} == {
        (kv, f, m) for kv in ("fp8", "bf16") for f in ARGS["fracs"] for m in bench_fetch.MECHANISMS}
    for r in rows:
        rb = {"fp8": 656, "bf16": 1152}[r["kv_dtype"]]
        assert r["row_bytes"] == rb
        assert r["misses"] == B * round(r["frac"] * K)
        assert r["payload_bytes"] == r["misses"] * L * rb
        moved = {"chunked": B * K,  # one chunk (of 256, cut to the 128 slots)
                 "packed": min(s for s in sizes if s >= r["misses"]), "static": B * K,
                 "page": r["distinct_host_pages"] * 64}[r["mechanism"]]
        assert r["moved_bytes"] == moved * L * rb, r
        if r["mechanism"] in ("packed", "static"):
            assert (r["host_computations"], r["h2d_copies"]) == (1, 1)
        if r["mechanism"] == "chunked":
            assert r["host_computations"] == r["h2d_copies"] == (3 if r["kv_dtype"] == "fp8" else 2)
        assert r["seconds"] > 0 and r["payload_gb_s"] > 0
    assert {(g["kv_dtype"], g["frac"]) for g in res["host_gather"]} == {
        (kv, f) for kv in ("fp8", "bf16") for f in ARGS["fracs"]}


def test_bytes_model_at_the_gpu_geometry(res):
    """At B 32, top-k 2048, 4 layers: the packed fetch moves at most twice the payload, B x K always moves it all."""
    m = res["bytes_model_gpu_geometry"]
    for kv, rb in (("fp8", 656), ("bf16", 1152)):
        for frac in ARGS["fracs"]:
            d = m[kv][str(frac)]
            assert d["static"]["bytes"] == 32 * 2048 * 4 * rb
            assert 1 <= d["packed"]["x_payload"] <= 2
            assert d["payload"]["bytes"] <= d["packed"]["bytes"] <= d["static"]["bytes"]
