"""The float64 oracle: dense masked softmax attention in numpy, with gradients.

Written from the contract alone (a membership table, no gather, no chunking),
so it shares no code path with the references or kernels it judges. Memory is
O(B * Hq * S_q * S_kv): for small shapes only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["membership", "oracle_forward_backward", "relative_error"]


def membership(routes: np.ndarray, kv_length: int) -> np.ndarray:
    """Boolean ``[B, S_q, S_kv]``: True where ``r`` is a valid route of row (b, i)."""
    routes = np.asarray(routes)
    b, s, _ = routes.shape
    table = np.zeros((b, s, kv_length + 1), dtype=bool)
    valid = (routes >= 0) & (routes < kv_length)
    ids = np.where(valid, routes, kv_length).astype(np.int64)
    np.put_along_axis(table, ids, True, axis=2)
    return table[..., :kv_length]


def oracle_forward_backward(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    routes: np.ndarray,
    scale: float,
    grad_out: np.ndarray | None = None,
) -> tuple[np.ndarray, ...]:
    """Float64 ``out`` and, if ``grad_out`` is given, ``(out, dq, dk, dv)``.

    Shapes as in the contract: query ``[B,S_q,Hq,D]``, key/value ``[B,S_kv,Hkv,D]``,
    routes ``[B,S_q,K]``. Rows without routes give exact zeros everywhere.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    bsz, s_q, hq, d = q.shape
    s_kv, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    mask = membership(routes, s_kv)[:, None]  # [B,1,S_q,S_kv]
    qh = q.transpose(0, 2, 1, 3)  # [B,Hq,S_q,D]
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)  # [B,Hq,S_kv,D]
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
    scores = np.where(mask, scale * qh @ kh.transpose(0, 1, 3, 2), -np.inf)
    row_max = scores.max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.where(mask, np.exp(scores - row_max), 0.0)
    denom = weights.sum(-1, keepdims=True)
    probs = weights / np.where(denom > 0, denom, 1.0)
    out_h = probs @ vh
    out = out_h.transpose(0, 2, 1, 3)
    if grad_out is None:
        return (out,)
    do = np.asarray(grad_out, dtype=np.float64).transpose(0, 2, 1, 3)
    dp = do @ vh.transpose(0, 1, 3, 2)
    # delta = sum_j P_ij dP_ij (equal to dO_i . O_i in exact arithmetic): a row with one
    # route then gets dS = 1 * (dP - dP) = 0 exactly, as its gradient is, instead of
    # float64 rounding noise that makes any relative error against it meaningless
    ds = probs * (dp - (probs * dp).sum(-1, keepdims=True))
    dq = scale * ds @ kh
    dk_h = scale * ds.transpose(0, 1, 3, 2) @ qh
    dv_h = probs.transpose(0, 1, 3, 2) @ do

    def fold(t: np.ndarray) -> np.ndarray:  # [B,Hq,S_kv,D] -> [B,S_kv,Hkv,D]
        return t.reshape(bsz, hkv, group, s_kv, d).sum(2).transpose(0, 2, 1, 3)

    return out, dq.transpose(0, 2, 1, 3), fold(dk_h), fold(dv_h)


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """``||actual - expected|| / ||expected||`` in float64; inf if ``actual`` has NaN/inf.

    When ``expected`` is all zeros the absolute norm of ``actual`` is returned.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {e.shape}")
    if not np.all(np.isfinite(a)):
        return float("inf")
    ref = float(np.linalg.norm(e))
    diff = float(np.linalg.norm(a - e))
    return diff / ref if ref > 0 else diff
