"""Our model == transformers' DeepseekV32ForCausalLM / GlmMoeDsaForCausalLM (tiny random configs, CPU, fp32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REFERENCE_SKIP_REASON

from hisparse_jax.generate import generate

torch = pytest.importorskip("torch", reason=REFERENCE_SKIP_REASON)
pytest.importorskip("transformers", reason=REFERENCE_SKIP_REASON)

SEQ = 40  # > index_topk (8): the sparse path is exercised


def rel_err(a, b):
    return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))


def capture_hf_topk(model, ids):
    """Run the transformers model and record every full indexer's top-k [B, T, K] (int64)."""
    recorded, hooks = [], []
    for layer in model.model.layers:
        idx = layer.self_attn.indexer
        if idx is not None:
            hooks.append(idx.register_forward_hook(lambda mod, args, out: recorded.append(out.clone())))
    try:
        with torch.no_grad():
            logits = model(ids).logits.numpy()
    finally:
        for h in hooks:
            h.remove()
    return logits, recorded


def causal_sets(topk: np.ndarray):
    """int[B, T, K] -> per (b, t) the set of selected positions <= t (drops -1 and masked picks)."""
    B, T, _ = topk.shape
    return [[set(int(s) for s in topk[b, t] if 0 <= s <= t) for t in range(T)] for b in range(B)]


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, SEQ), generator=g)


def test_logits_and_topk_match(hf_pair, ids):
    kind, hf, ours = hf_pair
    ref, hf_topk = capture_hf_topk(hf, ids)
    got, aux = ours.forward(jnp.asarray(ids.numpy(), jnp.int32))
    assert rel_err(got, ref) <= 1e-4, kind
    assert len(aux["topk"]) == len(hf_topk) == ours.cfg.num_indexer_layers
    for mine, theirs in zip(aux["topk"], hf_topk):
        assert causal_sets(np.asarray(mine)) == causal_sets(theirs.numpy())


def test_reference_is_prefix_consistent(hf_pair, ids):
    """The parity config has enough indexer heads that transformers itself agrees with itself on prefixes
    (FACTS: with few heads ReLU ties make torch.topk's pick depend on the length)."""
    _, hf, _ = hf_pair
    with torch.no_grad():
        full = hf(ids).logits.numpy()
        prefix = hf(ids[:, :SEQ - 7]).logits.numpy()
    assert rel_err(full[:, :SEQ - 7], prefix) < 1e-5


def test_attention_math_with_reference_topk():
    """Fed transformers' top-k sets, our layers reproduce its logits even where our own selection would differ
    (few indexer heads -> ties)."""
    import jax.numpy as jnp

    import hisparse_jax as hj
    from tiny import hf_model

    hf = hf_model("glm", seed=3, index_n_heads=2)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = hj.load_pretrained(d, dtype=jnp.float32)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(5))
    ref, hf_topk = capture_hf_topk(hf, ids)
    override = []
    for t in hf_topk:
        t = t.numpy()
        pos = np.arange(t.shape[1])[None, :, None]
        override.append(jnp.asarray(np.where(t <= pos, t, -1), jnp.int32))
    got, aux = ours.forward(jnp.asarray(ids.numpy(), jnp.int32), topk_override=override)
    assert rel_err(got, ref) <= 1e-4


def test_greedy_generation_matches_transformers(hf_pair, ids):
    kind, hf, ours = hf_pair
    prompts = [ids[0, :SEQ - 10].tolist(), ids[1, :SEQ - 17].tolist()]
    for p in prompts:
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, len(p):]
        got = generate(ours, [p], max_new_tokens=16)[0]
        assert got == ref.tolist(), kind
    # batched, different prompt lengths: the same tokens as one at a time
    batched = generate(ours, prompts, max_new_tokens=16)
    assert batched == [generate(ours, [p], max_new_tokens=16)[0] for p in prompts]
