"""Multi-token-prediction (MTP) speculative decoding through the tiered store.

The DeepSeek-V3.2 / GLM-5 checkpoints carry an MTP layer (`model.mtp[0]`, see `hisparse_jax.model.mtp`): from the
main model's final hidden state at position i and the token at i + 1 it predicts the token at i + 2. With k
speculative tokens, one engine step is one jitted call (`speculative_step_impl`) that

1. **verifies**: runs the main model over k + 1 rows per request — the pending token t_n and the drafts
   d_1..d_k at positions n..n+k — each row with its own indexer top-k, the k + 1 rows of a request resolved
   as ONE union of their top-k against the request's hot buffer (`TieredKV(rows_per_request=k + 1)`: no row
   evicts a hot row another row of the step still reads; each distinct missing row is fetched once);
2. **accepts** (`verify_rows`, rule `ACCEPTANCE`): "match" (default) samples every row's next token with the
   request's (seed, position) key — exactly the token non-speculative decoding would sample there — and
   accepts the drafts while they equal it, so outputs are identical to non-speculative decoding, sampled as
   well as greedy; "rejection" is the standard speculative-sampling rule for a deterministic (greedy) draft:
   accept draft d with probability p(d) under the target's temperature / top-p distribution p, else draw the
   token from p with d removed — the same output distribution, more drafts accepted when sampling, but the
   tokens then depend on the drafts. Greedy rows (temperature 0) accept d iff it is the argmax under both
   rules. The request emits a + 1 tokens (a = 0..k accepted drafts and the token after them);
3. **drafts**: runs the MTP layer over the verified rows 0..a (next tokens = the sampled ones, writing the
   MTP layer's KV at n..n+a) and takes the greedy draft from row a; for k > 1 the same layer is applied
   recursively k - 1 more times, one row per request at n+a+1.. (vLLM applies its one MTP layer the same way).

KV rows written for rejected positions (main layers at n+a+1..n+k, the MTP layer's speculative rows) lie
beyond the request's new length n + a + 1: nothing reads a position before the step that owns it rewrites it.
The host reserves each request's pages up to position n + 2k - 1 (`lookahead(k)` positions past the pending
token) before the step; at most two pages, the tail the store never releases.

Shapes: G requests (a bucket) x S = k + 1 rows, flattened group-major: rows g*S .. g*S+k are request g's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hisparse_jax.engine.sampling import nucleus_logits, sample_rows, token_key
from hisparse_jax.kv import tiered
from hisparse_jax.kv.state import KVStore
from hisparse_jax.kv.writes import end_step
from hisparse_jax.model.decoder import decode_step as model_decode_step
from hisparse_jax.model.mtp import mtp_decode_step


ACCEPTANCE = ("match", "rejection")


def verify_rows(logits, drafts, draft_ok, seeds, positions, temperatures, top_ps, rule: str = "match"):
    """Accept drafts. logits f32[G, S, V] of the S = k + 1 verified rows of G requests; drafts int32[G, k] (row
    j < k verifies drafts[:, j]); draft_ok bool[G, k] (False: no draft, never accepted); seeds / temperatures /
    top_ps [G]; positions int32[G, S] (of the token each row emits: its PRNG key). Returns (tokens int32[G, S]
    — row j's emitted token if it is reached —, accepted int32[G]: the request emits tokens[:, :accepted + 1])."""
    G, S, V = logits.shape
    k = S - 1
    rep = lambda a: jnp.repeat(a, S)  # noqa: E731  per request -> per row
    target = sample_rows(logits.reshape(G * S, V), rep(seeds), positions.reshape(-1), rep(temperatures),
                         rep(top_ps)).reshape(G, S)
    match = (target[:, :k] == drafts) & draft_ok
    if rule == "match":
        ok = match
        tokens = target
    elif rule == "rejection":
        def one(lg, d, seed, pos, t, p):
            masked = nucleus_logits(lg, t, p)
            keep = jax.random.uniform(jax.random.fold_in(token_key(seed, pos), 1)) < jax.nn.softmax(masked)[d]
            rest = jnp.where(jnp.arange(V) == d, -jnp.inf, masked)  # p without d, renormalized by the draw
            return keep, jax.random.categorical(token_key(seed, pos), rest).astype(jnp.int32)

        rk = lambda a: jnp.repeat(a, k)  # noqa: E731
        keep, resid = jax.vmap(one)(logits[:, :k].reshape(G * k, V), drafts.reshape(-1), rk(seeds),
                                    positions[:, :k].reshape(-1), rk(temperatures), rk(top_ps))
        keep, resid = keep.reshape(G, k), resid.reshape(G, k)
        sampled = (temperatures > 0)[:, None]
        ok = jnp.where(sampled, keep & draft_ok, match)
        first = jnp.where(ok, drafts, resid)  # a rejected row emits the residual draw
        tokens = jnp.concatenate([jnp.where(sampled & draft_ok, first, target[:, :k]), target[:, k:]], axis=1)
    else:
        raise ValueError(f"unknown acceptance rule {rule!r}; choose one of {', '.join(ACCEPTANCE)}")
    accepted = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    return tokens, accepted


def lookahead(k: int) -> int:
    """Positions past the pending token a speculative step may write: n + 1 .. n + 2k - 1 (the verified rows
    reach n + k, the recursive drafts n + a + k - 1 <= n + 2k - 1)."""
    return max(2 * k - 1, 0)


def speculative_step_impl(model, store: KVStore, batch: dict, sampling: dict, kernels: str, k: int,
                   acceptance: str = "match"):
    """One verify + accept + draft step (un-jitted). batch: tokens / req / pos int32[G*S] (row j of group g:
    [t_n, d_1..d_k][j], the request's slot or -1, n + j), draft_ok int32[G*S] (0 where a request has no draft
    for that row: its token is a placeholder, never accepted), index_span int32[P] (shape only). sampling: seed /
    temperature / top_p per group [G]. Returns (target int32[G, S] — each row's sampled next token —, accepted
    int32[G], drafts int32[G, k], store, stats)."""
    spec = store.spec
    S = k + 1
    scored_pages = batch["index_span"].shape[0]
    req = batch["req"].astype(jnp.int32)
    G = req.shape[0] // S
    pos = jnp.where(req >= 0, batch["pos"], -1)
    verify = tiered.TieredKV(spec, kernels, scored_pages, rows_per_request=S)
    logits, kv, _, hidden = model_decode_step(model, batch["tokens"].astype(jnp.int32), pos,
                                              verify.init_kv(store, req), verify, return_hidden=True)
    target, accepted = verify_rows(logits.reshape(G, S, -1), batch["tokens"].reshape(G, S)[:, 1:],
                                   batch["draft_ok"].reshape(G, S)[:, 1:] > 0, sampling["seed"],
                                   (jnp.maximum(pos, 0) + 1).reshape(G, S), sampling["temperature"],
                                   sampling["top_p"], acceptance)

    # the MTP layer over the verified rows 0..a: its KV at n..n+a, the first draft from row a
    j = jnp.arange(S, dtype=jnp.int32)[None]
    greq = req.reshape(G, S)[:, 0]
    live = (req.reshape(G, S) >= 0) & (j <= accepted[:, None])
    mreq = jnp.where(live, req.reshape(G, S), -1).reshape(-1)
    kv = dict(kv, req=mreq, plan=None)
    mlogits, mhidden, kv = mtp_decode_step(model, target.reshape(-1), jnp.where(mreq >= 0, pos, -1),
                                           hidden, kv, verify)
    g = jnp.arange(G)
    last = lambda a: a.reshape(G, S, *a.shape[1:])[g, accepted]  # noqa: E731  row a of each group
    draft = jnp.argmax(last(mlogits), axis=-1).astype(jnp.int32)
    h = last(mhidden)
    base = jnp.where(greq >= 0, pos.reshape(G, S)[:, 0] + accepted, -1)  # n + a: the last verified position
    drafts = [draft]
    one = tiered.TieredKV(spec, kernels, scored_pages)
    for i in range(1, k):  # recursive drafts, one row per request at n + a + i
        kv = dict(kv, req=greq, plan=None)
        lg, h, kv = mtp_decode_step(model, drafts[-1], jnp.where(greq >= 0, base + i, -1), h, kv, one)
        drafts.append(jnp.argmax(lg, axis=-1).astype(jnp.int32))
    span = max(S, 2 * k)  # every row this step wrote, all layers: positions n .. n + 2k - 1
    wreq = jnp.repeat(greq, span)
    wpos = jnp.where(wreq >= 0, (pos.reshape(G, S)[:, :1] + jnp.arange(span)[None]).reshape(-1), -1)
    store, stats = end_step(kv["store"], kv["stats"], (wreq, wpos), (greq, base + 1))
    return target, accepted, jnp.stack(drafts, axis=1), store, stats
