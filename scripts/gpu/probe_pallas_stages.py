"""Which JAX Pallas kernel asks for more shared memory than the H200 has, and which stage
count fits: forward alone and forward+backward at (24,2) D=256 bf16, S=32768, B=1, window
routes (W = 2052), for the default block sizes (two forward stages), three and one.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 scripts/gpu/probe_pallas_stages.py --out p.json
"""

from __future__ import annotations

import argparse
import dataclasses

from gpu_common import Record, relative_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=32768)
    args = parser.parse_args()
    import jax
    import jax.numpy as jnp

    import qsa_jax
    from qsa_jax.pallas_qsa import BlockSizes

    s, width = args.seq_len, 2052
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (1, s, h, 256), jnp.bfloat16) for kk, h in zip(keys, (24, 2, 2, 24)))
    i = jnp.arange(s)[:, None] - jnp.arange(width)[None]
    routes = jnp.where(i >= 0, i, -1).astype(jnp.int32)[None]
    default = BlockSizes.default(256, False, jnp.bfloat16, (9, 0))
    record = Record(args.out, default_block_sizes=str(default))
    reference = {}
    for name, bs in (("default", default), ("stages3", dataclasses.replace(default, num_stages=3)),
                     ("stages1", dataclasses.replace(default, num_stages=1))):
        def forward(bs=bs):
            f = jax.jit(lambda a, b, c, r: qsa_jax.sparse_gqa_attention(a, b, c, r, implementation="pallas",
                                                                        block_sizes=bs))
            return f(q, k, v, routes)

        def step(bs=bs, name=name):
            def both(a, b, c, r, g):
                out, pull = jax.vjp(lambda x, y, z: qsa_jax.sparse_gqa_attention(
                    x, y, z, r, implementation="pallas", block_sizes=bs), a, b, c)
                return (out, *pull(g))
            got = jax.block_until_ready(jax.jit(both)(q, k, v, routes, do))
            reference.setdefault("first", got)
            return {n: relative_error(x, y) for n, x, y in zip(("out", "dq", "dk", "dv"), got, reference["first"])}

        record.run(name, "forward", lambda: float(jnp.abs(forward()).max()))
        record.run(name, "forward+backward (vs the first that ran)", step)


if __name__ == "__main__":
    main()
