"""Which files of `hisparse_jax/` one HiSparse engine step runs, in the order it first runs them: the measurement
behind docs/architecture.md.

The step batches a running request's decode row with a 64-token chunk of a newly admitted prompt (the "tiny-glm"
preset: GLM's layer pattern in 4 layers). Jit caches are cleared first, so the device program is traced again and
its Python counts too; a profiler (`sys.setprofile`) records every function called during that one `Engine.step`.

    PYTHONPATH=. python experiments/step_route.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hisparse_jax")
# read only for sizes and types (docs/architecture.md's count leaves them out, and the model behind decode_step)
SIZE_AND_TYPE_FILES = ("kv/spec.py", "kv/state.py", "engine/request.py", "compat.py", "config.py")


def route() -> dict:
    """{"files": the package's files the step ran, in order (paths under hisparse_jax/), "counted": those besides
    model/ and SIZE_AND_TYPE_FILES, "step": what the step did}."""
    import jax
    import numpy as np
    from flax import nnx

    import hisparse_jax as hj
    from hisparse_jax.config import CacheConfig
    from hisparse_jax.engine import Engine, EngineConfig, SamplingParams

    cfg = hj.get_preset("tiny-glm")  # GLM's layer pattern, 4 layers (full / shared indexers, dense / MoE MLPs)
    eng = Engine(hj.SparseMLAModel(cfg, rngs=nnx.Rngs(0)),
                 CacheConfig(kv_dtype="float32", device_pages=16, host_pages=32, max_seqs=2, max_seq_len=512),
                 EngineConfig(policy="hisparse", prefill_chunk=64, max_running=2))
    rng = np.random.default_rng(0)
    eng.add_request("decoding", rng.integers(0, cfg.vocab_size, 40).tolist(), SamplingParams(max_new_tokens=8))
    eng.step()  # its prompt, whole in one chunk
    eng.step()  # now it decodes
    eng.add_request("prefilling", rng.integers(0, cfg.vocab_size, 200).tolist(), SamplingParams(max_new_tokens=4))
    jax.clear_caches()
    root, files = PACKAGE + os.sep, []

    def record(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root) and name[len(root):] not in files:
            files.append(name[len(root):])

    sys.setprofile(record)
    try:
        m = eng.step()
    finally:
        sys.setprofile(None)
    counted = [f for f in files if not f.startswith("model/") and f not in SIZE_AND_TYPE_FILES]
    return {"files": files, "counted": counted,
            "step": {"tokens": m.tokens, "prefill_tokens": m.prefill_tokens, "decode_tokens": m.decode_tokens,
                     "compiled": m.compiled, "misses": m.misses}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="", help="also write the result as JSON here")
    args = p.parse_args(argv)
    r = route()
    print(f"{len(r['files'])} files of hisparse_jax/ ran ({len(r['counted'])} besides model/ and the size/type "
          "files):")
    for f in r["files"]:
        print(f"  {f}{'' if f in r['counted'] else '  (not counted)'}")
    if args.out:
        from experiments.report import save_json

        save_json(args.out, r)
    else:
        print(json.dumps(r["step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
