"""One controller of a multi-process `generate(..., mesh=...)` run (tests/e2e/test_multiprocess.py starts two).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        python tests/mp_worker.py PROCESS_ID NUM_PROCESSES PORT

Every process runs this same program: `jax.distributed.initialize` on loopback, the same seeded model and prompts,
then `generate` over a mesh of all processes' devices. Prints one JSON line: this process's view of the tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPT_SEED, NUM_PROMPTS, STEPS = 5, 6, 6


def model_and_prompts():
    """The tiny 2-layer model (seed 0) and the prompts (130-300 tokens); the test builds the same ones."""
    import numpy as np
    from flax import nnx

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import hisparse_jax as hj
    from tiny import model_cfg

    cfg = model_cfg(num_hidden_layers=2, indexer_types=("full", "shared"), mlp_layer_types=("dense", "sparse"))
    model = hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(PROMPT_SEED)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(130, 300, NUM_PROMPTS)]
    return model, prompts


def main(process_id: int, num_processes: int, port: int) -> dict:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
    t0 = time.perf_counter()
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=60)
    try:
        from hisparse_jax import parallel
        from hisparse_jax.config import CacheConfig
        from hisparse_jax.generate import generate

        model, prompts = model_and_prompts()
        # per device: 7 pages for up to 2 requests of up to 5 pages + a hot page each: pages released, misses
        small = CacheConfig(kv_dtype="float32", device_pages=7, host_pages=24, max_seqs=2, max_seq_len=384)
        mesh = parallel.data_mesh()  # every process's devices
        toks, stats = generate(model, prompts, STEPS, cache=small, mesh=mesh, return_stats=True)
        return {"process_index": jax.process_index(), "process_count": jax.process_count(),
                "devices": len(jax.devices()), "local_devices": len(jax.local_devices()),
                "mesh_local": parallel.is_local(mesh), "tokens": toks, "misses": int(stats.misses),
                "evicted_pages": int(stats.evicted_pages), "seconds": time.perf_counter() - t0}
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))), flush=True)
