"""The model's full context on one GPU: S = 262144 (``max_position_embeddings``), B = 1.

    python3 scripts/gpu/long_context.py --out $OUT [--budget-s 225] [--heads 12:1,24:2]

For each head layout ((12,1) then (24,2); D = 256, bf16, QSA-format routes of one
262144-token document, top_k 512, width 2052, from ``qsa_common``):

1. the tile-sparse backends' answer, up front: ``flex_sparse_gqa_attention`` is called
   and must refuse before allocating (its message and the allocated bytes before and
   after are recorded); for FA4 the memory it would need (``fa4_qsa._memory_needed``,
   tables kept for the backward) is compared with the free memory, and its refusal
   message recorded where it would refuse (it is not run: it does dense-causal work);
2. torch Triton through ``qsa_torch.sparse_gqa_attention(backend="triton")``: forward and
   forward+backward wall time (CUDA events, one timed run after a warm-up), peak
   ``torch.cuda.max_memory_allocated`` (absolute and above the inputs);
3. JAX's default (``qsa_jax.sparse_gqa_attention`` on the same inputs, through DLPack)
   under ``jax.jit`` + ``jax.vjp``: compile time, forward+backward wall time, peak
   ``memory_stats()['peak_bytes_in_use']`` above the inputs;
4. correctness on sampled rows: the torch reference (fp32, on the GPU) on 256 sampled
   query rows (first, last and random ones) gives their outputs and, with the upstream
   gradient zero outside those rows, dq of those rows and the whole dk, dv; each backend
   runs its backward once more with that masked gradient. Relative errors must be below
   the contract's bf16 tolerance (1e-2).

The routes take about a minute to generate in numpy; a child process makes them while
the parent warms up the Triton kernels. Writes ``long_context.json`` (every entry with
its seconds or its error) and ``long_context.md`` under --out. Exit status 1 if a check
failed or a backend raised. ``--seq-len`` and ``--device cpu`` (Triton interpreter,
Pallas interpret mode) exist for a dry run of the plumbing at a small size.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX next to torch

import numpy as np  # noqa: E402
from gpu_common import Record, log, relative_error  # noqa: E402

TOLERANCE = 1e-2  # the contract's bf16 tolerance
SAMPLED_ROWS = 256


def make_routes(seq_len: int, top_k: int, path: str) -> float:
    """QSA-format routes of one document, int32 ``[1, S, 4 * top_k + 4]``, saved to ``path``;
    returns the seconds the generator took."""
    from qsa_common.generators import qsa_format_routes

    start = time.time()
    routes = qsa_format_routes(seq_len, top_k=top_k, rng=np.random.default_rng(0))
    seconds = time.time() - start
    np.save(path, routes.astype(np.int32)[None])
    return seconds


def sampled_rows(seq_len: int, count: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    fixed = [0, 1, 2, 3, 4, 5, 2051, 2052, seq_len - 2, seq_len - 1]
    rows = np.concatenate([[r for r in fixed if r < seq_len], rng.integers(0, seq_len, count)])
    return np.unique(rows)[:count]


class TorchCase:
    """Inputs of one head layout on the device, the sampled rows and their reference."""

    def __init__(self, torch, device, seq_len, heads, head_dim, routes_np):
        self.torch, self.device = torch, device
        hq, hkv = heads
        gen = torch.Generator(device=device).manual_seed(hq)
        def draw(*shape):
            return torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)

        self.q, self.do = draw(1, seq_len, hq, head_dim), draw(1, seq_len, hq, head_dim)
        self.k, self.v = draw(1, seq_len, hkv, head_dim), draw(1, seq_len, hkv, head_dim)
        self.routes = torch.from_numpy(routes_np).to(device)
        self.scale = head_dim**-0.5
        self.rows = torch.from_numpy(sampled_rows(seq_len, SAMPLED_ROWS)).to(device)
        self.do_masked = torch.zeros_like(self.do)
        self.do_masked[:, self.rows] = self.do[:, self.rows]
        self.reference = None

    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.routes, self.do,
                                                          self.do_masked))

    def compute_reference(self):
        """out and dq of the sampled rows, dk and dv of the masked gradient (fp32)."""
        from qsa_torch import reference_sparse_gqa_attention

        q = self.q[:, self.rows].float().requires_grad_(True)
        k, v = (t.float().requires_grad_(True) for t in (self.k, self.v))
        out = reference_sparse_gqa_attention(q, k, v, self.routes[:, self.rows], self.scale)
        out.backward(self.do[:, self.rows].float())
        self.reference = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        return {"rows": int(self.rows.numel())}

    def errors(self, out, dq, dk, dv) -> dict:
        """Relative errors of a backend's sampled rows (out, dq) and masked-gradient dk, dv."""
        got = {"out": out[:, self.rows], "dq": dq[:, self.rows], "dk": dk, "dv": dv}
        errors = {name: relative_error(got[name], want) for name, want in self.reference.items()}
        errors["pass"] = all(e < TOLERANCE for e in errors.values())
        return errors


def flex_refusal(case: TorchCase) -> dict:
    from qsa_torch import flex_sparse_gqa_attention

    torch = case.torch
    q, k, v = (t.detach().requires_grad_(True) for t in (case.q, case.k, case.v))
    before = torch.cuda.memory_allocated()
    start = time.time()
    try:
        flex_sparse_gqa_attention(q, k, v, case.routes, case.scale)
    except torch.OutOfMemoryError as err:
        return {"refused": True, "message": str(err), "seconds_to_refuse": round(time.time() - start, 3),
                "allocated_before": before, "allocated_after": torch.cuda.memory_allocated()}
    raise RuntimeError("flex_sparse_gqa_attention accepted the full context")


def fa4_estimate(case: TorchCase) -> dict:
    from qsa_torch import fa4_qsa
    from qsa_torch.routes import ProblemDims, available_device_bytes

    b, s, hq, d = case.q.shape
    dims = ProblemDims(b, s, s, hq, case.k.shape[2], d, case.routes.shape[2])
    tables, need = fa4_qsa._memory_needed(dims, needs_grad=True)
    free = available_device_bytes(case.q.device)
    result = {"tables_gib": tables / 2**30, "needs_gib": need / 2**30, "free_gib": free / 2**30,
              "refused": need > free}
    try:
        fa4_qsa._check_memory(dims, True, free)
    except case.torch.OutOfMemoryError as err:
        result["message"] = str(err)
    return result


def cuda_seconds(torch, fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def torch_triton(case: TorchCase) -> dict:
    from qsa_torch import sparse_gqa_attention

    torch = case.torch
    on_cuda = case.device == "cuda"

    def leaves():
        return [t.detach().requires_grad_(True) for t in (case.q, case.k, case.v)]

    def step(grad):
        x = leaves()
        out = sparse_gqa_attention(*x, case.routes, case.scale, backend="triton")
        out.backward(grad)
        return out, x

    start = time.time()
    step(case.do)  # warm-up: compiles the kernels for this layout
    result = {"first_call_s": round(time.time() - start, 2)}
    if on_cuda:
        with torch.no_grad():
            result["forward_s"] = cuda_seconds(torch, lambda: sparse_gqa_attention(
                case.q, case.k, case.v, case.routes, case.scale, backend="triton"))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result["forward_backward_s"] = cuda_seconds(torch, lambda: step(case.do))
        peak = torch.cuda.max_memory_allocated()
        result.update(peak_gib=peak / 2**30, peak_above_inputs_gib=(peak - before) / 2**30,
                      inputs_gib=case.input_bytes() / 2**30)
    out, x = step(case.do_masked)
    result["errors"] = case.errors(out.detach(), *(t.grad for t in x))
    return result


def torch_to_jax(torch, t):
    """A torch tensor as a JAX array: shared through DLPack, else copied via the host."""
    import jax
    import jax.numpy as jnp

    try:
        return jax.dlpack.from_dlpack(t.contiguous())
    except Exception:  # noqa: BLE001 -- any DLPack refusal: copy through the host
        if t.dtype == torch.bfloat16:
            bits = jnp.asarray(t.contiguous().view(torch.int16).cpu().numpy())
            return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
        return jnp.asarray(t.cpu().numpy())


def jax_default(case: TorchCase) -> dict:
    import jax
    import jax.numpy as jnp

    from qsa_jax import sparse_gqa_attention

    torch = case.torch
    q, k, v, do, do_masked, routes = (torch_to_jax(torch, t) for t in (
        case.q, case.k, case.v, case.do, case.do_masked, case.routes))
    scale = case.scale

    def step(q_, k_, v_, g_, r_):
        out, pull = jax.vjp(lambda a, b, c: sparse_gqa_attention(a, b, c, r_, scale), q_, k_, v_)
        return (out, *pull(g_))

    start = time.time()
    compiled = jax.jit(step).lower(q, k, v, do, routes).compile()
    result = {"compile_s": round(time.time() - start, 2)}
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    before = stats.get("bytes_in_use")
    start = time.time()
    jax.block_until_ready(compiled(q, k, v, do, routes))
    result["first_run_s"] = round(time.time() - start, 3)
    start = time.time()
    jax.block_until_ready(compiled(q, k, v, do, routes))
    result["forward_backward_s"] = round(time.time() - start, 3)
    stats = device.memory_stats() or {}
    if before is not None and "peak_bytes_in_use" in stats:
        result["peak_above_inputs_gib"] = (stats["peak_bytes_in_use"] - before) / 2**30
        result["note"] = "peak_bytes_in_use never resets: a later layout's peak is the larger of the two"
    out, dq, dk, dv = compiled(q, k, v, do_masked, routes)
    as_torch = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32)))  # noqa: E731
    result["errors"] = case.errors(*(as_torch(a).to(case.device) for a in (out, dq, dk, dv)))
    return result


def write_markdown(path: str, results: dict) -> None:
    top_k = results["top_k"]
    lines = [f"# S = {results['seq_len']}, B = 1, D = {results['head_dim']}, bf16, QSA routes "
             f"(top_k {top_k}, width {4 * top_k + 4})", "",
             f"routes generated in {results.get('routes', {}).get('generate', {}).get('result')} s", ""]
    for layout, entries in results.items():
        if not layout.startswith("heads "):
            continue
        lines += [f"## {layout}", "", "| check | result | seconds |", "|---|---|---|"]
        for name, entry in entries.items():
            shown = entry.get("error") or entry.get("skipped") or entry.get("result")
            lines.append(f"| {name} | `{str(shown)[:600]}` | {entry.get('seconds', '')} |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seq-len", type=int, default=262144)
    parser.add_argument("--heads", default="12:1,24:2")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=512)
    parser.add_argument("--budget-s", type=float, default=225.0)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    record = Record(os.path.join(args.out, "long_context.json"), budget_s=args.budget_s,
                    seq_len=args.seq_len, head_dim=args.head_dim, top_k=args.top_k, device=args.device)
    # not under --out: 2 GiB of routes must not travel back with the results
    routes_path = os.path.join(tempfile.mkdtemp(prefix="qsa-long-context-"), "routes.npy")
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        pending = pool.submit(make_routes, args.seq_len, args.top_k, routes_path)
        import torch

        heads = [tuple(int(x) for x in h.split(":")) for h in args.heads.split(",")]
        if args.device == "cuda":
            record.results["gpu"] = torch.cuda.get_device_name(0)
            width = 4 * args.top_k + 4
            small = np.random.default_rng(0).integers(-1, 4096, (1, 4096, width)).astype(np.int32)
            for hq, hkv in heads:  # compile the Triton kernels while the routes are made
                warm = TorchCase(torch, args.device, 4096, (hq, hkv), args.head_dim, small)
                record.run("warm-up", f"triton {hq}:{hkv}", lambda warm=warm: torch_triton(warm)["first_call_s"])
                del warm
        record.run("routes", "generate", lambda: round(pending.result(), 1))
    if not os.path.exists(routes_path):
        write_markdown(os.path.join(args.out, "long_context.md"), record.results)
        return 1
    routes_np = np.load(routes_path)
    os.remove(routes_path)
    os.rmdir(os.path.dirname(routes_path))
    failed = False
    cases = {}
    # torch first for every layout, then JAX: JAX keeps the memory it grew into, which
    # would shrink what the flex and FA4 checks see as free
    for hq, hkv in heads:
        section = f"heads {hq}:{hkv}"
        case = cases[section] = TorchCase(torch, args.device, args.seq_len, (hq, hkv), args.head_dim,
                                          routes_np)
        record.run(section, "reference rows", case.compute_reference)
        if args.device == "cuda":
            failed |= record.run(section, "flex refusal", lambda case=case: flex_refusal(case)) is None
            record.run(section, "fa4 memory", lambda case=case: fa4_estimate(case))
        value = record.run(section, "torch triton", lambda case=case: torch_triton(case), margin_s=10)
        failed |= value is None or not value["errors"]["pass"]
    if args.device == "cuda":
        torch.cuda.empty_cache()
    for section, case in cases.items():
        value = record.run(section, "jax default", lambda case=case: jax_default(case), margin_s=10)
        failed |= value is None or not value["errors"]["pass"]
    write_markdown(os.path.join(args.out, "long_context.md"), record.results)
    log("failed" if failed else "all checks passed", "->", args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
