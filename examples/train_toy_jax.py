"""Train a two-layer toy language model built on the Qwen3.8-Flash-Next QSA layer on CPU.

Each training row packs four documents (``cu_seqlens``); each document repeats
a random 4-token phrase, so after the first repeat the next token can be
copied from 4 positions back, which only attention can do. The model is
embeddings -> 2 x (RMSNorm -> QSAAttention -> residual -> RMSNorm -> MLP ->
residual) -> RMSNorm -> logits, with ``qsa_jax.qwen3_8_flash_next.QSAAttention``
at a toy size (its frozen indexer keeps 4 four-token blocks plus the causal
tail). ``optax.adamw`` updates the ``nnx.Param`` weights only, inside
``nnx.jit``; the indexer's frozen weights never change.

    python examples/train_toy_jax.py --steps 40
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

from qsa_jax.qwen3_8_flash_next import QSAAttention, QSAConfig, rotary_freqs  # noqa: E402

VOCAB, SEQ, DOCS, PHRASE = 16, 256, 8, 4
CONFIG = QSAConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5,
                   indexer_n_heads=2, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4,
                   initializer_range=0.2, dtype="float32")


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, implementation=None):
        dim = CONFIG.hidden_size
        self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = QSAAttention(CONFIG, rngs=rngs, implementation=implementation)
        self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x, freqs_cis, cu_seqlens):
        x = x + self.attn(self.norm1(x), freqs_cis=freqs_cis, cu_seqlens=cu_seqlens)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ToyModel(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, implementation=None):
        self.embed = nnx.Embed(VOCAB, CONFIG.hidden_size, rngs=rngs)
        self.block1 = Block(rngs=rngs, implementation=implementation)
        self.block2 = Block(rngs=rngs, implementation=implementation)
        self.norm = nnx.RMSNorm(CONFIG.hidden_size, rngs=rngs)
        self.head = nnx.Linear(CONFIG.hidden_size, VOCAB, rngs=rngs)

    def __call__(self, tokens, positions, cu_seqlens):
        freqs_cis = rotary_freqs(CONFIG, positions)
        x = self.embed(tokens)
        x = self.block2(self.block1(x, freqs_cis, cu_seqlens), freqs_cis, cu_seqlens)
        return self.head(self.norm(x))


def make_batch(rng: np.random.Generator):
    """``(tokens [1, SEQ], positions [1, SEQ], cu_seqlens [DOCS + 1])``: DOCS repeated phrases
    packed in one row; positions restart at every document."""
    cuts = np.sort(rng.choice(np.arange(8, SEQ - 8), DOCS - 1, replace=False))
    cu = np.concatenate([[0], cuts, [SEQ]]).astype(np.int32)
    tokens = np.empty(SEQ, np.int32)
    positions = np.empty(SEQ, np.int32)
    for lo, hi in zip(cu[:-1], cu[1:]):
        tokens[lo:hi] = np.resize(rng.integers(0, VOCAB, PHRASE), hi - lo)
        positions[lo:hi] = np.arange(hi - lo)
    return jnp.asarray(tokens[None]), jnp.asarray(positions[None]), jnp.asarray(cu)


def loss_fn(model, tokens, positions, cu_seqlens):
    """Mean next-token cross-entropy within documents."""
    logits = model(tokens, positions, cu_seqlens)[:, :-1]
    same_doc = positions[:, 1:] > 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(ce * same_doc) / jnp.sum(same_doc)


@nnx.jit
def train_step(model, optimizer, tokens, positions, cu_seqlens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, positions, cu_seqlens)
    optimizer.update(model, grads)
    return loss


def train(steps: int = 40, seed: int = 0, lr: float = 1e-2, implementation=None, verbose=False,
          return_model=False):
    """Train for ``steps`` steps; return the list of training losses (and the model)."""
    rng = np.random.default_rng(seed)
    model = ToyModel(rngs=nnx.Rngs(seed), implementation=implementation)
    optimizer = nnx.Optimizer(model, optax.adamw(lr, weight_decay=1e-4), wrt=nnx.Param)
    losses = []
    for step in range(steps):
        losses.append(float(train_step(model, optimizer, *make_batch(rng))))
        if verbose:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    return (losses, model) if return_model else losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)
    losses = train(args.steps, args.seed, args.lr, verbose=True)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
