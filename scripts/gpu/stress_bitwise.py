"""Bitwise repeatability of the default CUDA path, run after run, under load.

    python3 scripts/gpu/stress_bitwise.py --out DIR --budget-s 300          # torch
    python3 scripts/gpu/stress_bitwise.py --out DIR --budget-s 300 --jax    # JAX beside torch
    python3 scripts/gpu/stress_bitwise.py --out DIR --dry-run                 # CPU, Triton's interpreter

What every launch of the Triton kernels promises: the same inputs give the same bits for
the forward's results (output, LSE, route unions), the default backward's dQ, and the
deterministic backward's dQ/dK/dV; and where ``--jax`` is given, ``qsa_jax``'s triton
implementation (jax-triton) gives torch's bits for the output and the deterministic
gradients. A warp-specialized kernel whose buffers or barriers race shows as a rare run
whose bits differ, more often when other processes load the GPU; so ``run.sh check`` runs
this beside other GPU work, and it repeats each case until the budget is spent.

Cases, taken in turn: B=1 packed and B=2 padded, (24,2) and (12,1), D=256, bf16, QSA routes
(top_k 512) at adjacent-row Jaccard 0.3 and 0.8, S=8192 (``--seq-len``). Each case's inputs are
fixed; its first run is the reference. Writes stress_bitwise.json (after every case round)
and prints a VERDICT line: the runs per case and every mismatch (which result, how many
elements, the first (batch, row, head) positions that differ).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import numpy as np  # noqa: E402
from gpu_common import log  # noqa: E402  (puts the repository root on sys.path)


def bits(x) -> np.ndarray:
    """A torch tensor's raw bits as an unsigned numpy array (bf16 / fp32 / int)."""
    import torch

    x = x.detach().contiguous().cpu()
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}.get(x.dtype)
    return (x.view(view) if view is not None else x).numpy()


def where_differ(a: np.ndarray, b: np.ndarray, limit: int = 5) -> dict:
    diff = np.argwhere(a != b)
    return {"elements": int(len(diff)), "of": int(a.size), "first": diff[:limit].tolist()}


class Case:
    """One problem on the GPU, its reference bits, and the mismatches seen since."""

    def __init__(self, layout, heads, overlap, seq_len, seed, device, use_jax):
        import torch

        from qsa_common.layouts import make_problem

        hq, hkv = heads
        self.name = f"{layout} {hq}:{hkv} J{overlap}"
        batch = 1 if layout == "packed" else 2
        problem = make_problem(layout, "qsa", seed=seed, seq_len=seq_len, top_k=512 if seq_len >= 4096 else 16,
                               batch=batch, overlap=overlap)
        self.routes_np = problem.routes.astype(np.int32)
        self.routes = torch.from_numpy(self.routes_np).to(device)
        b = self.routes.shape[0]
        g = torch.Generator(device=device).manual_seed(seed)
        self.q, self.k, self.v, self.do = (
            torch.randn(b, seq_len, h, 256, device=device, generator=g).to(torch.bfloat16) for h in (hq, hkv, hkv, hq))
        self.top_k = self.routes.shape[2]
        self.use_jax = use_jax
        self.runs = 0
        self.mismatches: list[dict] = []
        self.reference = self.once()

    def once(self) -> dict:
        import torch

        from qsa_torch import triton_qsa

        scale = 1 / 16
        with torch.no_grad():
            out, lse, union, count, rowbits = triton_qsa.forward_with_residuals(
                self.q, self.k, self.v, self.routes, scale)
            result = {"out": out, "lse": lse, "union": union, "count": count, "rowbits": rowbits}
            for deterministic in (False, True):
                dq, dk, dv = triton_qsa.backward_from_residuals(
                    self.do, self.q, self.k, self.v, out, lse, union, count, rowbits, scale, self.top_k,
                    deterministic=deterministic)
                if deterministic:
                    result.update(det_dq=dq, det_dk=dk, det_dv=dv)
                else:
                    result["dq"] = dq
        result = {name: bits(x) for name, x in result.items()}
        if self.use_jax:
            result.update(self.jax_once())
        return result

    def jax_once(self) -> dict:
        import jax
        import jax.numpy as jnp

        from qsa_jax import triton_qsa as jt

        if not hasattr(self, "_jax"):
            jq, jk, jv, jdo = (jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16)
                               for x in (self.q, self.k, self.v, self.do))
            jroutes = jnp.asarray(self.routes_np)
            fwd = jax.jit(lambda a, b, c: jt.triton_sparse_gqa_attention(a, b, c, jroutes, 1 / 16))

            def loss(a, b, c):
                out = jt.triton_sparse_gqa_attention(a, b, c, jroutes, 1 / 16, deterministic=True)
                return jnp.sum(out.astype(jnp.float32) * jdo.astype(jnp.float32))

            self._jax = (fwd, jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (jq, jk, jv))
        fwd, grad, args = self._jax
        as_bits = lambda x: np.asarray(x).view(np.int16)  # noqa: E731
        result = {"jax_out": as_bits(fwd(*args))}
        result.update(zip(("jax_det_dq", "jax_det_dk", "jax_det_dv"), map(as_bits, grad(*args))))
        return result

    def check(self) -> None:
        now = self.once()
        self.runs += 1
        for name, ref in self.reference.items():
            if not np.array_equal(now[name], ref):
                self.mismatches.append({"run": self.runs, "result": name, **where_differ(now[name], ref)})
        if self.use_jax:  # JAX against torch, every run
            for name in ("out", "det_dq", "det_dk", "det_dv"):
                ours, theirs = now[f"jax_{name}"], now[name].view(np.int16)
                if not np.array_equal(ours, theirs):
                    self.mismatches.append({"run": self.runs, "result": f"jax_{name} against torch",
                                            **where_differ(ours, theirs)})

    def summary(self) -> dict:
        return {"case": self.name, "runs": self.runs, "mismatches": self.mismatches[:20],
                "mismatch_count": len(self.mismatches)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--jax", action="store_true", help="also qsa_jax's triton implementation, against torch")
    parser.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, tiny problems, two rounds")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cpu" if args.dry_run else "cuda"
    seq_len = 64 if args.dry_run else args.seq_len
    grid = [("packed", (24, 2), 0.8), ("padded", (24, 2), 0.3), ("packed", (12, 1), 0.3), ("padded", (12, 1), 0.8)]
    if args.dry_run:
        grid = [("packed", (4, 2), 0.8)]
    cases, errors = [], []
    for i, (layout, heads, overlap) in enumerate(grid):
        try:
            cases.append(Case(layout, heads, overlap, seq_len, 100 + i, device, args.jax))
        except Exception as err:  # a case that cannot even start is reported, the others still run
            errors.append(f"{layout} {heads} J{overlap}: {type(err).__name__}: {err}")
            log("setup failed:", errors[-1])
    rounds = 0
    for case in itertools.cycle(cases):
        if time.time() - t0 > args.budget_s or (args.dry_run and rounds >= 2 * len(cases)):
            break
        case.check()
        rounds += 1
        if rounds % len(cases) == 0:
            record = {"command": " ".join(sys.argv), "seq_len": seq_len, "jax": args.jax, "seconds": time.time() - t0,
                      "setup_errors": errors, "cases": [c.summary() for c in cases]}
            with open(os.path.join(args.out, "stress_bitwise.json"), "w") as f:
                json.dump(record, f, indent=1)
    total = sum(c.runs for c in cases)
    bad = sum(len(c.mismatches) for c in cases)
    for c in cases:
        log(c.name, "runs", c.runs, "mismatches", len(c.mismatches), c.mismatches[:3])
    ok = bad == 0 and not errors and total > 0
    log(f"VERDICT {'PASS' if ok else 'FAIL'}: {total} runs over {len(cases)} cases, {bad} mismatches, "
        f"{len(errors)} setup errors, {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
