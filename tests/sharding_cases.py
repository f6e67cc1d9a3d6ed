"""Sharded cases of ``qsa_jax.sparse_gqa_attention`` on 8 host devices, run by
tests/test_sharding.py in a subprocess (XLA reads the device count once, before JAX
starts). Prints one JSON object: per case the collectives in the compiled forward and
gradient, the output's and gradients' PartitionSpecs, the relative errors against the
float64 oracle and against the same jitted call on one device, and the WARNINGs the
``"qsa_jax"`` logger gave.

Usage: ``python tests/sharding_cases.py [--gpu] CASE [CASE ...]`` (names in ``CASES``).
``--gpu``: the GPUs of the host instead of 8 host devices (the meshes shrink to fit:
data x model = 2 x 4 on 8 GPUs, 1 x 2 on 2; the sequence over up to 4), kernels compiled
instead of interpreted.
"""

from __future__ import annotations

import os
import sys

GPU = "--gpu" in sys.argv[1:]
if not GPU:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=4", "")
        + " --xla_force_host_platform_device_count=8").strip()

import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from contract_base import random_inputs

import qsa_jax
from qsa_common.layouts import make_problem
from qsa_common.oracle import oracle_forward_backward, relative_error

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


WARNINGS = _Warnings()
logging.getLogger("qsa_jax").addHandler(WARNINGS)


def count_collectives(compiled, source: str = "") -> dict[str, int]:
    """Collective instructions (``-start`` forms of async ones counted once); with
    ``source``, only those whose ``op_name`` metadata contains it."""
    lines = compiled.as_text().splitlines()
    return {name: sum(1 for line in lines if re.match(rf"\s*(?:ROOT )?%\S+ = .* {name}(?:-start)?\(", line)
                      and source in line) for name in COLLECTIVES}


def spec(x) -> list:
    """``x``'s PartitionSpec as a list without trailing Nones (P('a', None) == P('a'))."""
    entries = [list(e) if isinstance(e, tuple) else e for e in x.sharding.spec]
    while entries and entries[-1] is None:
        entries.pop()
    return entries


def run(mesh, specs, problem, heads, head_dim, impl, scale=None):
    """Compile and run forward and gradient on the mesh and on one device; compare."""
    rng = np.random.default_rng()
    routes = problem.routes.astype(np.int32)
    q, k, v, do = random_inputs(rng, routes, problem.kv_length, heads, head_dim, "float32")
    scale = head_dim ** -0.5 if scale is None else scale
    kw = {"implementation": impl, **({"interpret": True} if impl == "pallas" and not GPU else {})}

    def forward(q, k, v, r):
        return qsa_jax.sparse_gqa_attention(q, k, v, r, scale, **kw)

    def loss(q, k, v, r, do):
        return jnp.sum(forward(q, k, v, r) * do)

    fwd = jax.jit(forward)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    q_spec, kv_spec, r_spec = specs
    host = [q, k, v, routes, do]
    placed = [jax.device_put(x.astype(np.float32) if x.dtype.kind == "f" else x, NamedSharding(mesh, s))
              for x, s in zip(host, (q_spec, kv_spec, kv_spec, r_spec, q_spec))]
    out, grads = fwd(*placed[:4]), grad(*placed)
    one = _devices()[0]
    single = [jax.device_put(x.astype(np.float32) if x.dtype.kind == "f" else x, one) for x in host]
    out1, grads1 = fwd(*single[:4]), grad(*single)
    want = oracle_forward_backward(q, k, v, routes, scale, do)
    got, got1 = (out, *grads), (out1, *grads1)
    names = ("out", "dq", "dk", "dv")
    return {
        "fwd_collectives": count_collectives(fwd.lower(*placed[:4]).compile()),
        "grad_collectives": count_collectives(grad.lower(*placed).compile()),
        "specs": {name: spec(x) for name, x in zip(names, got)},
        "input_specs": {"query": spec(placed[0]), "key": spec(placed[1])},
        "error_vs_oracle": {n: relative_error(np.asarray(g), w) for n, g, w in zip(names, got, want)},
        "error_vs_single": {n: relative_error(np.asarray(g), np.asarray(s)) for n, g, s in zip(names, got, got1)},
    }


def _devices():
    return jax.devices("gpu") if GPU else jax.devices("cpu")


def _mesh(shape, names):
    return Mesh(np.array(_devices()[: int(np.prod(shape))]).reshape(shape), names)


def _probe_mesh():
    n = len(_devices())
    model = 4 if n >= 8 else 2
    return _mesh((min(2, n // model), model), ("data", "model"))


def probe(impl, heads=(8, 4), kv_heads_axis="model"):
    """The issue's probe: mesh (data=2, model=4), B=4, S=256, D=64, batch and heads split
    (K/V heads over ``kv_heads_axis``)."""
    problem = make_problem("padded", "qsa", seed=int(np.random.default_rng().integers(2**31)), seq_len=256,
                           batch=4, top_k=4, width=24)
    q_spec, kv_spec = P("data", None, "model", None), P("data", None, kv_heads_axis, None)
    return run(_probe_mesh(), (q_spec, kv_spec, P("data", None, None)), problem, heads, 64, impl)


def sequence(impl):
    """Context parallel: the sequence of query/key/value/routes over 4 devices (and the
    batch over 2 where 8 are present)."""
    problem = make_problem("padded", "qsa", seed=int(np.random.default_rng().integers(2**31)), seq_len=256,
                           batch=2, top_k=4, width=24)
    n = len(_devices())
    seq = min(4, n)
    mesh = _mesh((min(2, n // seq), seq), ("data", "seq"))
    qkv = P("data", "seq", None, None)
    return run(mesh, (qkv, qkv, P("data", "seq", None)), problem, (4, 2), 32, impl)


def flax_port(seq_split: int = 1):
    """``QSAAttention`` under ``nnx.jit``: weights split over heads, activations over the
    batch (and over the sequence in ``seq_split`` parts)."""
    from flax import nnx

    from qsa_jax.qwen3_8_flash_next import QSAAttention, QSAConfig, rotary_freqs

    cfg = QSAConfig(dtype="float32", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    indexer_n_heads=2, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4)
    mesh = _mesh((2, 2, seq_split), ("data", "model", "seq"))
    rng = np.random.default_rng()
    bsz, seq = 4, 64
    x = rng.standard_normal((bsz, seq, cfg.hidden_size)).astype(np.float32)
    dy = rng.standard_normal((bsz, seq, cfg.hidden_size)).astype(np.float32)
    freqs = np.asarray(rotary_freqs(cfg, np.broadcast_to(np.arange(seq), (bsz, seq))))
    seed = int(rng.integers(2**31))

    def build(head_axis):
        layer = QSAAttention(cfg, rngs=nnx.Rngs(seed), head_axis=head_axis)
        for var in (layer.q_norm, layer.k_norm):
            var[...] = jnp.asarray(np.random.default_rng(seed).uniform(-0.5, 0.5, var.shape), jnp.float32)
        return layer

    @nnx.jit
    def loss_and_grads(layer, x, freqs, dy):
        def loss(layer):
            return jnp.sum(layer(x, freqs_cis=freqs) * dy)

        return nnx.value_and_grad(loss)(layer)

    def results(layer, args):
        value, grads = loss_and_grads(layer, *args)
        flat = {"/".join(map(str, path)): np.asarray(leaf) for path, leaf in
                jax.tree_util.tree_leaves_with_path(nnx.state(grads, nnx.Param))}
        return float(value), flat

    with jax.set_mesh(mesh):  # flax creates annotated variables sharded on the mesh in context
        sharded = build("model")
    data = NamedSharding(mesh, P("data", "seq" if seq_split > 1 else None))
    args = [jax.device_put(a, data) for a in (x, freqs, dy)]
    graphdef, state = nnx.split(sharded)
    compiled = jax.jit(lambda s, *a: loss_and_grads(nnx.merge(graphdef, s), *a)).lower(state, *args).compile()
    value, grads = results(sharded, args)
    single_value, single_grads = results(build(None), [jnp.asarray(a) for a in (x, freqs, dy)])
    kernel_specs = {name: spec(getattr(sharded, name).kernel[...]) for name in ("q_proj", "k_proj", "o_proj")}
    if os.environ.get("QSA_DUMP"):
        print("\n".join(l for l in compiled.as_text().splitlines() if re.search("all-gather|all-reduce", l)))
    return {
        "grad_collectives": count_collectives(compiled),
        "attention_collectives": count_collectives(compiled, "custom_partitioning"),
        "global_attention_shapes": _full_attention_shapes(compiled.as_text(), bsz, seq, cfg),
        "has_local_query_shape": f"f32[{bsz // 2},{seq // seq_split},{cfg.num_attention_heads // 2},{cfg.head_dim}]"
                                 in compiled.as_text(),
        "kernel_specs": kernel_specs,
        "error_value": abs(value - single_value) / abs(single_value),
        "error_grads": {k: relative_error(grads[k], single_grads[k]) for k in single_grads},
    }


def _full_attention_shapes(text, bsz, seq, cfg) -> list[str]:
    """The global query/key shapes ``[B, S, H, D]`` that some instruction holds (a
    replicated attention would); the local ones are ``[B/2, S, H/2, D]``."""
    shapes = [f"f32[{bsz},{seq},{h},{cfg.head_dim}]" for h in (cfg.num_attention_heads, cfg.num_key_value_heads)]
    return [s for s in shapes if s in text]


CASES = {
    "probe_xla": lambda: probe("xla"),
    "probe_pallas": lambda: probe("pallas"),
    "probe_triton": lambda: probe("triton"),
    "sequence_triton": lambda: sequence("triton"),
    "sequence_xla": lambda: sequence("xla"),
    "sequence_pallas": lambda: sequence("pallas"),
    "heads_not_divisible_xla": lambda: probe("xla", heads=(8, 2), kv_heads_axis=None),
    "flax_port": flax_port,
    "flax_port_sequence": lambda: flax_port(seq_split=2),
}


def main(names):
    results = {}
    for name in names:
        del WARNINGS.messages[:]
        result = CASES[name]()
        result["warnings"] = list(WARNINGS.messages)
        results[name] = result
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a != "--gpu"] or [c for c in CASES if "triton" not in c])
