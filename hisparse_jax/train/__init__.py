"""Training a small DSA model on real text (the Python standard library's sources), so that the indexer's
selections, and the hit rates measured on them, come from attention that has learned something.

* `data`   the corpus: stdlib `.py` files as bytes, a hash-of-path held-out split, random / fixed windows;
* `dsa`    the three stages DeepSeek trained DSA with (dense LM, indexer KL warm-up, sparse), the training
           forward, the losses, `train_stage` (optax AdamW, frozen groups under `set_to_zero`) and `evaluate`;
* `recipe` the shipped model's config (`STDLIB_DSA`) and its recipes.

The command is `experiments/train_locality_model.py`. Needs optax (a dependency of flax).
"""
