"""Bitwise-reproducible dK/dV of the token-gather Triton backend (no fp32 atomics).

The torch side of ``qsa_triton.kv_backward`` (the algorithm, and its cost relative to
the fused atomic backward, are described there):

* :func:`build_inverse_index`: per block of ``block_n`` consecutive keys of one batch
  row, the ascending distinct query rows that route to any of its keys and, per such
  row, an int64 mask of which of the block's keys it routes to (a set: repeated IDs
  count once, IDs outside ``[0, S_kv)`` are ignored). One Triton kernel writes a sort
  key per route, ``torch.sort`` orders them, an integer prefix count numbers the (block,
  row) pairs and a second kernel writes each pair's row and ORs its key bits. No host
  synchronisation: the index is sized by the static bound ``B * S_q * min(K, n_blocks)``.
* :func:`deterministic_dk_dv`: one program per (key block, batch row, KV head) walks its
  block's rows in index order and writes its dK/dV once: the same inputs give the same
  bits on every run. Programs start longest first (the index's ``order``): on QSA routes
  at S = 32768 the longest 32-key block has 3.3x the mean block's rows, 0.86x the work
  that each of an H200's 132 SMs gets in a balanced run (two KV heads), so a long block
  started last would set the kernel's time. dQ is not computed here.
* :func:`attention_delta`: ``sum_d dO * O`` per (row, head), the backward's delta.

Triton is imported on the first call. CUDA tensors, or CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from qsa_triton.launch import fp32

from . import _triton_launch
from .routes import validate_inputs, validate_routes

__all__ = [
    "DEFAULT_KV_BLOCK_SIZES",
    "InverseRouteIndex",
    "KVBlockSizes",
    "attention_delta",
    "build_inverse_index",
    "default_kv_block_sizes",
    "deterministic_dk_dv",
]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_BLOCK_N_CHOICES = (16, 32, 64)  # the key masks are int64
_INDEX_BLOCK = 1024  # route entries per program of the index kernels
_MAX_GRID = 2**31 - 1  # CUDA's limit on grid dimension x
_MAX_SORT = 2**31 - 1  # elements of one torch.sort
_MAX_INT32_KEY = 2**31 - 1  # index sort keys are int32 up to this, else int64


@dataclass(frozen=True)
class KVBlockSizes:
    """Launch configuration of the dK/dV kernel.

    ``block_n``: keys per program, which is also the inverse index's block (16, 32 or
    64). ``block_m``: (query row, head) pairs per step, a power of two >= 16.
    ``num_warps``, ``num_stages``: Triton's (more than one stage moves the block's K/V
    copy into shared memory inside the loop).
    """

    block_n: int = 32
    block_m: int = 128
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        if self.block_n not in _BLOCK_N_CHOICES:
            raise ValueError(f"KVBlockSizes.block_n must be one of {_BLOCK_N_CHOICES}, got {self.block_n!r}")
        m = self.block_m
        if not isinstance(m, int) or m < 16 or m & (m - 1):
            raise ValueError(f"KVBlockSizes.block_m must be a power of two >= 16, got {m!r}")
        for name in ("num_warps", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVBlockSizes.{name} must be a positive int, got {value!r}")


# 32 keys x 128 (row, head) pairs: the tiling that compiles for sm_90a without spills at
# D = 256 (qsa_triton.kv_backward), with less inflation than 64-key blocks on QSA routes;
# not yet timed on a GPU (scripts/gpu/probe_deterministic.py compares it with others).
DEFAULT_KV_BLOCK_SIZES = KVBlockSizes(block_n=32, block_m=128, num_warps=8, num_stages=1)
_LIGHT_KV_BLOCK_SIZES = KVBlockSizes(block_n=32, block_m=32, num_warps=4, num_stages=1)


def default_kv_block_sizes(device: torch.device, head_dim: int, dtype: torch.dtype) -> KVBlockSizes:
    """The tiling used when ``block_sizes`` is None: :data:`DEFAULT_KV_BLOCK_SIZES` for
    16-bit inputs on SM90+ GPUs, else a lighter one (fp32 dots need twice the shared
    memory; older GPUs have less)."""
    if device.type == "cuda" and dtype != torch.float32 and torch.cuda.get_device_capability(device) >= (9, 0):
        return DEFAULT_KV_BLOCK_SIZES
    return _LIGHT_KV_BLOCK_SIZES


@dataclass(frozen=True)
class InverseRouteIndex:
    """Which query rows attend to each block of ``block_n`` consecutive keys.

    Segment ``s = b * n_blocks + j`` (batch row b, keys ``[j * block_n, (j + 1) *
    block_n)``) is ``start[s] .. start[s + 1]``: ``rows`` int32 holds its query rows,
    ascending and distinct; ``bits`` int64 holds per row the mask of the block's keys
    it routes to (bit n: key ``j * block_n + n``; never zero). ``start`` int64
    ``[B * n_blocks + 1]``; ``rows`` and ``bits`` are ``[B * S_q * min(K, n_blocks)]``,
    valid up to ``start[-1]``. ``order`` int32 ``[B * n_blocks]``: the segments by
    descending number of rows (ties in segment order), the kernel's launch order.
    """

    rows: torch.Tensor
    bits: torch.Tensor
    start: torch.Tensor
    order: torch.Tensor
    block_n: int
    kv_length: int

    @property
    def n_blocks(self) -> int:
        return -(-self.kv_length // self.block_n)


def _load_kernels():
    """The kernel module (imports triton: ImportError without it) and whether Triton's
    interpreter runs it."""
    interpreted = _triton_launch.interpreted()
    from qsa_triton import kv_backward

    return kv_backward, interpreted


def _check_device(device: torch.device, interpreted: bool, what: str) -> None:
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"{what} is on {device}: the deterministic Triton backward needs CUDA tensors "
                         "(CPU tensors only with TRITON_INTERPRET=1 set before triton is imported)")


def _on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it ``device``."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def build_inverse_index(routes: torch.Tensor, kv_length: int, block_n: int = 32) -> InverseRouteIndex:
    """The inverse route index of ``routes`` (no host synchronisation).

    Args:
        routes: ``[B, S_q, K]`` signed int32/int64, any strides; IDs outside
            ``[0, kv_length)`` (negative, past the end, huge int64) are padding and
            repeated IDs count once.
        kv_length: S_kv, in ``[1, 2**31)``.
        block_n: keys per block: 16, 32 or 64.

    Returns:
        :class:`InverseRouteIndex` on the routes' device.

    Sort keys are ``(b * (n_blocks + 1) + j) * S_q + i`` for a route of row i to block j
    of batch row b, and block ``n_blocks`` (one past the last) for padding, so that
    sorting each batch row's keys on its own (when all of them do not fit one
    ``torch.sort``) leaves the whole array sorted; int32 where they fit.
    """
    validate_routes(routes)
    if routes.dim() != 3 or routes.numel() == 0:
        raise ValueError(f"routes must be a non-empty [B, S_q, K] tensor, got shape {tuple(routes.shape)}")
    if not isinstance(kv_length, int) or not 0 < kv_length < 2**31:
        raise ValueError(f"kv_length must be an int in [1, 2**31), got {kv_length!r}")
    if block_n not in _BLOCK_N_CHOICES:
        raise ValueError(f"block_n must be one of {_BLOCK_N_CHOICES}, got {block_n!r}")
    kernels, interpreted = _load_kernels()
    _check_device(routes.device, interpreted, "selected_token_ids")
    bsz, s_q, k = routes.shape
    if s_q * k > _MAX_SORT:
        raise ValueError(f"one batch row has S_q * K = {s_q * k} routes, more than one torch.sort takes")
    device = routes.device
    n_blocks = -(-kv_length // block_n)
    log2_n = block_n.bit_length() - 1
    n_entries = bsz * s_q * k
    key_space = bsz * (n_blocks + 1) * s_q
    key_dtype = torch.int32 if key_space <= _MAX_INT32_KEY else torch.int64
    keys = _triton_launch.new_buffer(n_entries, key_dtype, device)
    grid = (-(-n_entries // _INDEX_BLOCK),)
    route_strides = dict(zip(("sr_b", "sr_s", "sr_k"), routes.stride()))
    with _on_device(device):
        kernels.inverse_keys_kernel[grid](
            ROUTES=routes, KEYS=keys, n_entries=n_entries, s_q=s_q, k=k, kv_length=kv_length, n_blocks=n_blocks,
            **route_strides, LOG2_BLOCK_N=log2_n, BLOCK=_INDEX_BLOCK)
    keys, source = _sort(keys, s_q * k)
    valid = (keys // s_q) % (n_blocks + 1) != n_blocks
    first = valid.clone()
    first[1:] &= keys[1:] != keys[:-1]
    slots = torch.cumsum(first, 0, dtype=torch.int32 if n_entries <= 2**31 - 1 else torch.int64)
    capacity = bsz * s_q * min(k, n_blocks)
    rows = _triton_launch.new_buffer(capacity, torch.int32, device)
    bits = torch.zeros(capacity, dtype=torch.int64, device=device)
    with _on_device(device):
        kernels.inverse_from_sorted_kernel[grid](
            KEYS=keys, SOURCE=source, SLOTS=slots, ROUTES=routes, ROWS=rows, BITS=bits, n_entries=n_entries,
            s_q=s_q, k=k, n_blocks=n_blocks, **route_strides, LOG2_BLOCK_N=log2_n, BLOCK=_INDEX_BLOCK)
    # segment s = b * n_blocks + j starts at key (b * (n_blocks + 1) + j) * S_q
    seg = torch.arange(bsz * n_blocks + 1, device=device, dtype=torch.int64)
    bounds = ((seg + seg // n_blocks) * s_q).to(key_dtype)
    before = torch.searchsorted(keys, bounds)
    start = torch.cat([slots.new_zeros(1), slots])[before].to(torch.int64)
    order = torch.argsort(start[:-1] - start[1:], stable=True).to(torch.int32)
    return InverseRouteIndex(rows, bits, start, order, block_n, kv_length)


def _sort(keys: torch.Tensor, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ascending keys and the positions they came from, in sorts of whole batch rows
    (``per_row`` keys each) of at most ``_MAX_SORT`` elements."""
    step = max(1, _MAX_SORT // per_row) * per_row
    if keys.numel() <= step:
        return torch.sort(keys)
    values, order = torch.empty_like(keys), torch.empty(keys.numel(), dtype=torch.int64, device=keys.device)
    for lo in range(0, keys.numel(), step):
        part = torch.sort(keys[lo:lo + step])
        values[lo:lo + step] = part.values
        order[lo:lo + step] = part.indices + lo
    return values, order


def attention_delta(out: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``delta[b, h, i] = sum_d grad_out[b, i, h, d] * out[b, i, h, d]`` in fp32.

    Args:
        out, grad_out: ``[B, S_q, Hq, D]``, any floating dtype and strides.

    Returns:
        fp32 ``[B, Hq, S_q]`` (contiguous in S_q), the layout of the forward's LSE.
    """
    if out.shape != grad_out.shape or out.dim() != 4:
        raise ValueError(f"out and grad_out must both be [B, S_q, Hq, D], got {tuple(out.shape)} "
                         f"and {tuple(grad_out.shape)}")
    return (out.float() * grad_out.float()).sum(-1).transpose(1, 2).contiguous()


def _check_rowwise(name: str, t, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} [B, Hq, S_q], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}")


def deterministic_dk_dv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    selected_token_ids: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    block_sizes: KVBlockSizes | None = None,
    index: InverseRouteIndex | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dK and dV of route-sparse GQA, accumulated in fp32 without atomics.

    Args:
        query: ``[B, S_q, Hq, D]`` fp16/bf16/fp32, CUDA (or CPU under the interpreter),
            any strides, D <= 256.
        key, value: ``[B, S_kv, Hkv, D]``, query's dtype and device; Hq % Hkv == 0.
        grad_out: ``[B, S_q, Hq, D]``, query's dtype: dLoss/dOut.
        lse: fp32 ``[B, Hq, S_q]``: the forward's natural-log log-sum-exp of each (row,
            head) (any value for rows without routes: they are never read).
        delta: fp32 ``[B, Hq, S_q]``: :func:`attention_delta` of the forward's output.
        selected_token_ids: ``[B, S_q, K]`` signed int32/int64 routes (the contract's set
            semantics).
        softmax_scale: finite positive scale, default ``1/sqrt(D)``.
        block_sizes: the kernel's tiling, default :func:`default_kv_block_sizes`.
        index: a prebuilt :func:`build_inverse_index` of these routes with
            ``block_sizes.block_n`` keys per block, else it is built here.

    Returns:
        ``(dk, dv)``: ``[B, S_kv, Hkv, D]`` in key's dtype, bitwise reproducible for
        the same inputs and tiling. Keys no row routes to get exact zeros.

    Raises:
        TypeError / ValueError: the contract's input checks, and for grad_out, lse,
            delta, block_sizes or index that do not match the inputs; ValueError also for
            D > 256 and for CPU tensors unless Triton's interpreter is on.
        ImportError: triton is not installed.
    """
    checked = validate_inputs(query, key, value, selected_token_ids, softmax_scale, dtypes=_DTYPES)
    dims = checked.dims
    bsz, s_q, hq, d = query.shape
    s_kv, hkv = key.shape[1], key.shape[2]
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be <= {_MAX_HEAD_DIM} for the Triton backward, got {d}")
    if not isinstance(grad_out, torch.Tensor):
        raise TypeError(f"grad_out must be a torch.Tensor, got {type(grad_out).__name__}")
    if grad_out.dtype != query.dtype:
        raise TypeError(f"grad_out dtype {grad_out.dtype} differs from query dtype {query.dtype}")
    if grad_out.shape != query.shape:
        raise ValueError(f"grad_out shape {tuple(grad_out.shape)} differs from query's {tuple(query.shape)}")
    if grad_out.device != query.device:
        raise ValueError(f"grad_out is on {grad_out.device} but query is on {query.device}")
    for name, t in (("lse", lse), ("delta", delta)):
        _check_rowwise(name, t, (bsz, hq, s_q), query.device)
    if block_sizes is not None and not isinstance(block_sizes, KVBlockSizes):
        raise TypeError(f"block_sizes must be a KVBlockSizes or None, got {type(block_sizes).__name__}")
    kernels, interpreted = _load_kernels()
    _check_device(query.device, interpreted, "query")
    blocks = block_sizes or default_kv_block_sizes(query.device, d, query.dtype)
    if index is None:
        index = build_inverse_index(selected_token_ids, s_kv, blocks.block_n)
    elif (not isinstance(index, InverseRouteIndex) or index.block_n != blocks.block_n
          or index.kv_length != s_kv or index.start.shape != (bsz * index.n_blocks + 1,)
          or index.order.shape != (bsz * index.n_blocks,) or index.start.device != query.device):
        raise ValueError(f"index does not belong to these routes with block_n={blocks.block_n} "
                         f"(S_kv={s_kv}, B={bsz}, device {query.device})")
    if s_q * dims.group_size > 2**31 - 1:
        raise ValueError(f"S_q * Hq / Hkv = {s_q * dims.group_size} (row, head) pairs per key block exceed "
                         "int32, which numbers them")
    if bsz * index.n_blocks * hkv > _MAX_GRID:
        raise ValueError(f"B * key blocks * Hkv = {bsz * index.n_blocks * hkv} programs exceed CUDA's "
                         f"grid limit {_MAX_GRID}: split the batch")
    dk = _triton_launch.new_buffer(key.shape, key.dtype, key.device)
    dv = _triton_launch.new_buffer(value.shape, value.dtype, value.device)
    args = dict(Q=query, K=key, V=value, DO=grad_out, LSE=lse, DELTA=delta, ROWS=index.rows, BITS=index.bits,
                START=index.start, ORDER=index.order, scale=fp32(checked.scale),
                scale_log2=fp32(checked.scale * kernels.LOG2E), DK=dk, DV=dv,
                S_kv=s_kv, N_BLOCKS=index.n_blocks, HKV=hkv, G=dims.group_size, D=d)
    for prefix, t in (("sq", query), ("sk", key), ("sv", value), ("sdo", grad_out), ("sdk", dk), ("sdv", dv)):
        args.update(zip((f"{prefix}_b", f"{prefix}_s", f"{prefix}_h", f"{prefix}_d"), t.stride()))
    for prefix, t in (("sl", lse), ("sdl", delta)):
        args.update(zip((f"{prefix}_b", f"{prefix}_h", f"{prefix}_s"), t.stride()))
    d_pad = max(16, 1 << (d - 1).bit_length())
    constexprs = dict(BLOCK_N=blocks.block_n, D_PAD=d_pad, IEEE=interpreted or query.dtype == torch.float32,
                      INTERPRET=interpreted, EVEN_D=d == d_pad)
    _launch(kernels.kv_backward_kernel, (bsz * index.n_blocks * hkv,), args, constexprs, blocks, query.device)
    return dk, dv


# (configuration, constexprs, device) -> (block_m, num_stages) that the device could load
_FITTING: dict[tuple, tuple[int, int]] = {}


def _launch(kernel, grid, args: dict, constexprs: dict, blocks: KVBlockSizes, device: torch.device) -> None:
    """Launch with ``blocks``; where the device lacks the shared memory for it (Triton
    raises OutOfResources on loading), retry with one stage, then narrower row chunks
    (the index does not depend on them), remembering what loaded."""
    cache_key = (blocks, tuple(sorted(constexprs.items())), str(device))
    attempts = [_FITTING[cache_key]] if cache_key in _FITTING else list(dict.fromkeys(
        [(blocks.block_m, blocks.num_stages)]
        + [(m, 1) for m in (blocks.block_m, blocks.block_m // 2, blocks.block_m // 4) if m >= 16]))
    for i, (block_m, stages) in enumerate(attempts):
        try:
            with _on_device(device):
                kernel[grid](**args, **constexprs, BLOCK_M=block_m, num_warps=blocks.num_warps, num_stages=stages)
        except Exception as exc:  # triton.runtime.errors.OutOfResources (triton is imported lazily)
            if type(exc).__name__ != "OutOfResources" or i == len(attempts) - 1:
                raise
            continue
        _FITTING[cache_key] = (block_m, stages)
        return
