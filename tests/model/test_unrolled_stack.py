"""ModelConfig.scan_layers=False: the unrolled stack computes what the scanned one does, and its gradient does not
pad each layer's weight gradient back to the full stack (the stack is split once, whose transpose is one
concatenate; slicing it per layer made the gradient L zero-padded full-size stacks summed, +73 ms a `reduced` step
on an H200: experiments/NOTES.md, issue 14)."""
import re

import jax
import numpy as np
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config, lm_loss


def _grad_fn(cfg):
    graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return jax.jit(jax.value_and_grad(lambda s, b: lm_loss(nnx.merge(graphdef, s), b)[0])), state, batch


def test_unrolled_matches_scanned():
    base = dict(n_layers=5, max_seq_len=16, dtype="float32", moe_path="dense_cf", capacity_factor=8.0)
    scanned, state, batch = _grad_fn(get_config("tiny", **base))
    unrolled, _, _ = _grad_fn(get_config("tiny", **base, scan_layers=False))
    (loss_s, grads_s), (loss_u, grads_u) = scanned(state, batch), unrolled(state, batch)
    np.testing.assert_allclose(loss_u, loss_s, rtol=1e-6)
    for u, s in zip(jax.tree.leaves(grads_u), jax.tree.leaves(grads_s)):
        np.testing.assert_allclose(u, s, rtol=1e-5, atol=1e-7)


def test_the_gradient_pads_no_stacked_weight():
    cfg = get_config("tiny", n_layers=5, max_seq_len=16, moe_path="dense_cf", scan_layers=False)
    fn, state, batch = _grad_fn(cfg)
    stacked = {"x".join(map(str, a.shape)) for a in jax.tree.leaves(state)
               if a.ndim >= 2 and a.shape[0] == cfg.n_layers - cfg.n_dense_layers}
    assert stacked, "no stacked weights found (the test would show nothing)"
    text = fn.lower(state, batch).as_text()
    padded = {m for line in text.splitlines() if "stablehlo.pad" in line
              for m in re.findall(r"-> tensor<((?:\d+x)+)", line)}
    assert not {p.rstrip("x") for p in padded} & stacked, sorted(padded)
