"""The miss fetch in the sm_90 build of GLM-5's whole decode step (fp8 KV, Pallas kernels): per indexer group and step,
one host computation and one host -> device copy, and no pool-sized temporary.

The step is `engine.runner._jitted_step`, built without a GPU by XLA's deviceless AOT compiler
(`hisparse_jax.deviceless`; skips, with the reason, without the CUDA plugin / ptxas / libdevice, e.g. on jax 0.10).
The row fetch (`kv.resolve.fetch_misses` with fetch="row") is a `lax.switch` on the group's miss count over its static staging sizes
(`resolve.fetch_sizes`): branch 0 (no misses) does nothing, each other branch makes exactly one host computation (an
XLA:GPU "HostExecute" call: the host-side gather of every miss's row, all layers of the group and all three host
pools, packed as `spec.row_bytes` bytes per row in 32-bit words) whose one result is written to device memory
(its host -> device copy), after one device -> host copy of the rows' addresses. Every host computation of the step is in such a
branch: none runs in a loop over chunks. The layers are scanned, so each run of layers (`model.decoder.layer_runs`,
one indexer group per iteration) holds one such switch.
"""

from __future__ import annotations

import os
import time

import pytest

from hisparse_jax import deviceless as dl
from hisparse_jax.gpu_build import (BATCH, abstract_step_args, check_no_pool_sized_temporary, glm5_layers,
                                    host_call_conditionals, host_call_outputs)

pytestmark = pytest.mark.skipif(dl.unavailable_reason() is not None, reason=str(dl.unavailable_reason()))

# The scanned step's program does not grow with depth: GLM-5's first 4 layers (three runs of layers, as in
# test_gpu_build.py's slice) build in ~20 s on 2 cores; HISPARSE_GPU_BUILD_ALL=1 builds all 78 (~80 s).
NUM_LAYERS = 78 if os.environ.get("HISPARSE_GPU_BUILD_ALL") else 4


@pytest.fixture(scope="module")
def built():
    """(cfg, spec, store, compiled HLO text, memory stats) of the whole GLM-5 step, fp8 KV, Pallas kernels."""
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import runner
    from hisparse_jax.kv.state import StoreSpec

    cfg = glm5_layers(NUM_LAYERS)
    cache = CacheConfig(kv_dtype="fp8", device_pages=4096, host_pages=16384, max_seqs=32, max_seq_len=131072,
                        fetch="row")
    graphdef, params, store, batch = abstract_step_args(cfg, cache)
    t0 = time.perf_counter()
    exe = dl.compile_lowered(dl.lower_for_gpu(runner._jitted_step(graphdef, "pallas"), params, store, batch))
    print(f"\nsm_90 build of glm-5[{NUM_LAYERS} layers] fp8 pallas, row fetch: {time.perf_counter() - t0:.1f} s")
    return cfg, StoreSpec.create(cfg, cache), store, dl.hlo_text(exe), exe.get_compiled_memory_stats()


def test_one_host_computation_and_one_copy_per_group(built):
    from hisparse_jax.kv.resolve import fetch_sizes
    from hisparse_jax.model.decoder import layer_runs

    cfg, spec, _, text, _ = built
    assert spec.row_bytes == 656  # 512 e4m3 + 4 fp32 scales + 64 bf16 rope
    switches = host_call_conditionals(text)
    assert len(switches) == len(layer_runs(cfg)), (len(switches), len(layer_runs(cfg)))
    K = min(spec.topk, spec.max_pages * 64)
    sizes = fetch_sizes(spec.fetch_min_rows, BATCH * K)
    assert sizes[-1] == BATCH * K and len(sizes) > 1
    group_sizes = {len(g) for g in spec.groups}
    for branches in switches:
        assert len(branches) == 1 + len(sizes)
        idle = branches[0]
        assert not idle["host_calls"] and not idle["d2h"] and not idle["h2d"], "the no-miss branch moves data"
        nl = branches[1]["host_calls"][0]["dims"][0]
        assert nl in group_sizes
        for size, b in zip(sizes, branches[1:]):
            assert len(b["host_calls"]) == 1, b["host_calls"]
            out = b["host_calls"][0]
            assert (out["dtype"], out["dims"], out["memory_space"]) == ("u32", (nl, size, spec.row_bytes // 4), 0), out
            assert [c["dims"] for c in b["d2h"]] == [(nl + 2 * size,)], b["d2h"]  # the addresses, in one copy
            assert not b["h2d"], b["h2d"]  # the host call's result is the one host -> device copy
    in_switches = sum(len(b["host_calls"]) for branches in switches for b in branches)
    assert len(host_call_outputs(text.splitlines())) == in_switches, "a host computation outside the fetch switch"


def test_no_pool_sized_temporary(built):
    _, _, store, text, mem = built
    check_no_pool_sized_temporary("glm-5 fp8 pallas row fetch", store, text, mem)
