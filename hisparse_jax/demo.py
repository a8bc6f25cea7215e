"""`hisparse demo`: sparse-MLA decoding on an embedded tiny model with the real cache geometry.

The model (`tiny-glm` preset: latent 512, rope 64, indexer 128, shared-index layers, MoE) has seeded
random weights, so nothing is downloaded. The demo prefills a batch of long prompts, decodes with the
jitted sparse step (each token attends to its indexer's top-k rows only), and checks the decoded
logits against a full causal forward over prompt + generated tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.config import PRESETS, get_preset
from hisparse_jax.generate import generate
from hisparse_jax.model.decoder import SparseMLAModel


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hisparse demo", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-glm", choices=sorted(k for k in PRESETS if k.startswith("tiny")))
    p.add_argument("--requests", type=int, default=4, help="number of prompts in the batch (default 4)")
    p.add_argument("--prompt-len", type=int, default=1024, help="longest prompt, tokens (default 1024)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def run(args) -> dict:
    cfg = get_preset(args.preset)
    model = SparseMLAModel(cfg, rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    lens = [max(16, int(args.prompt_len * f)) for f in np.linspace(1.0, 0.6, args.requests)]
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(f"model {args.preset}: {cfg.num_hidden_layers} layers, indexer {cfg.indexer_types}, top-k {cfg.index_topk}")
    log(f"compiling and warming up ({args.requests} prompts of {min(lens)}-{max(lens)} tokens) ...")
    generate(model, prompts, 2)
    t0 = time.perf_counter()
    generate(model, prompts, 1)
    prefill_s = time.perf_counter() - t0
    log("decoding ...")
    t0 = time.perf_counter()
    tokens, logits = generate(model, prompts, args.new_tokens, return_logits=True)
    total_s = time.perf_counter() - t0
    decode_s = max(total_s - prefill_s, 1e-9)
    # check: the last decoded distribution == a full causal forward over prompt + generated tokens
    seq = prompts[0] + tokens[0][:-1]
    full = nnx.jit(lambda m, x: m(x))(model, jnp.asarray([seq], jnp.int32))
    err = float(np.max(np.abs(np.asarray(full[0, -1]) - logits[0][-1])))
    ctx = [n + args.new_tokens for n in lens]
    return {
        "preset": args.preset, "requests": args.requests, "prompt_tokens": lens, "new_tokens": args.new_tokens,
        "index_topk": cfg.index_topk, "attended_fraction_at_end": [min(1.0, cfg.index_topk / c) for c in ctx],
        "prefill_s": prefill_s, "decode_s": decode_s,
        "decode_tokens_per_s": args.requests * (args.new_tokens - 1) / decode_s,
        "decode_vs_full_forward_max_abs_logit_diff": err, "jax_backend": jax.default_backend(),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.requests < 1 or args.prompt_len < 16 or args.new_tokens < 2:
        print("hisparse demo: need --requests >= 1, --prompt-len >= 16, --new-tokens >= 2", file=sys.stderr)
        return 2
    r = run(args)
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [("requests", r["requests"]), ("prompt tokens", f"{min(r['prompt_tokens'])}-{max(r['prompt_tokens'])}"),
            ("index top-k", r["index_topk"]),
            ("attended fraction (end)", f"{min(r['attended_fraction_at_end']):.1%}-"
                                        f"{max(r['attended_fraction_at_end']):.1%}"),
            ("prefill (s)", f"{r['prefill_s']:.2f}"), ("decode tokens/s", f"{r['decode_tokens_per_s']:.1f}"),
            ("decode vs full forward, max |dlogit|", f"{r['decode_vs_full_forward_max_abs_logit_diff']:.2e}")]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0
