"""Train a two-layer toy language model with QSA attention for a few steps on CPU.

Each row packs two documents; each document repeats a random 4-token phrase,
so after the first repeat the next token can be copied from 4 positions back,
which only attention can do. The model is embeddings -> 2 x (RMSNorm ->
QSAAttention -> residual -> RMSNorm -> MLP -> residual) -> RMSNorm -> logits,
trained with optax Adam inside ``nnx.jit``. The indexer picks the routes
(top_k = 4 blocks plus the causal tail); its own projections get no gradient
(see ``qsa_jax.layers.QSAAttention``).

    python examples/train_toy_jax.py --steps 30
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from qsa_jax.layers import QSAAttention  # noqa: E402

VOCAB, DIM, SEQ, BATCH, PHRASE = 16, 32, 64, 4, 4


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, implementation=None):
        self.norm1 = nnx.RMSNorm(DIM, rngs=rngs)
        self.attn = QSAAttention(DIM, 4, 2, 8, top_k=4, index_heads=2, index_dim=8,
                                 implementation=implementation, rngs=rngs)
        self.norm2 = nnx.RMSNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def __call__(self, x, segment_ids):
        x = x + self.attn(self.norm1(x), segment_ids=segment_ids)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ToyModel(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, implementation=None):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.block1 = Block(rngs=rngs, implementation=implementation)
        self.block2 = Block(rngs=rngs, implementation=implementation)
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens, segment_ids):
        x = self.embed(tokens)
        x = self.block2(self.block1(x, segment_ids), segment_ids)
        return self.head(self.norm(x))


def make_batch(rng: np.random.Generator):
    """``(tokens, segment_ids)`` [BATCH, SEQ]: two documents per row, each a repeated phrase."""
    tokens = np.empty((BATCH, SEQ), dtype=np.int32)
    segment_ids = np.empty((BATCH, SEQ), dtype=np.int32)
    for b in range(BATCH):
        cut = int(rng.integers(SEQ // 4, 3 * SEQ // 4))
        for doc, (lo, hi) in enumerate(((0, cut), (cut, SEQ))):
            phrase = rng.integers(0, VOCAB, PHRASE)
            tokens[b, lo:hi] = np.resize(phrase, hi - lo)
            segment_ids[b, lo:hi] = doc
    return jnp.asarray(tokens), jnp.asarray(segment_ids)


def loss_fn(model, tokens, segment_ids):
    """Mean next-token cross-entropy within documents."""
    logits = model(tokens[:, :-1], segment_ids[:, :-1])
    same_doc = segment_ids[:, 1:] == segment_ids[:, :-1]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * same_doc) / jnp.sum(same_doc)


@nnx.jit
def train_step(model, optimizer, tokens, segment_ids):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, segment_ids)
    optimizer.update(model, grads)
    return loss


def train(steps: int = 30, seed: int = 0, lr: float = 1e-2, implementation=None, verbose=False):
    """Train for ``steps`` steps; return the list of training losses."""
    rng = np.random.default_rng(seed)
    model = ToyModel(rngs=nnx.Rngs(seed), implementation=implementation)
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    losses = []
    for step in range(steps):
        tokens, segment_ids = make_batch(rng)
        losses.append(float(train_step(model, optimizer, tokens, segment_ids)))
        if verbose:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    losses = train(args.steps, args.seed, args.lr, verbose=True)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
