"""CUDA-event spans inside one step of a layer, for scripts/gpu/bench_nemo_layer.py.

:class:`Spans` collects named (start, end) event pairs while ``active``;
:func:`timed_dispatch` wraps an attention dispatch of upstream's signature so that an
active step records ``attn_fwd`` around the call and ``attn_bwd`` from the moment
autograd hands the gradient to the output to the moment dQ, dK and dV exist (two
identity autograd nodes record the events), and keeps the call's routes and shapes;
:func:`timed_function` records a span around any call. On CPU (dry runs)
:class:`HostEvent` stands in for ``torch.cuda.Event``.
"""

from __future__ import annotations

import time

import torch

__all__ = ["HostEvent", "Spans", "new_event", "synchronize", "timed_dispatch", "timed_function"]


class HostEvent:
    """CPU stand-in for ``torch.cuda.Event`` (dry runs)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


def new_event(device: torch.device):
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else HostEvent()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _GradEvent(torch.autograd.Function):
    """Identity on ``tensors`` whose backward records ``event`` once all their gradients exist."""

    @staticmethod
    def forward(ctx, event, *tensors):
        ctx.event = event
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.event.record()
        return (None, *grads)


class Spans:
    """Event pairs of one instrumented step, by name; inactive outside instrumented steps."""

    def __init__(self, device: torch.device):
        self.device, self.active, self.pairs, self.routes, self.call = device, False, {}, None, None

    def open(self, name: str):
        start, end = new_event(self.device), new_event(self.device)
        self.pairs.setdefault(name, []).append((start, end))
        return start, end

    def durations(self) -> dict[str, float]:
        return {name: sum(s.elapsed_time(e) for s, e in pairs) for name, pairs in self.pairs.items()}


def timed_dispatch(dispatch, spans: Spans):
    """``dispatch`` (upstream's signature) with attention forward/backward events."""

    def qsa_gqa_attention(query, key, value, selected_token_ids, *, backend, softmax_scale=None, flex_mask=None):
        if not spans.active:
            return dispatch(query, key, value, selected_token_ids, backend=backend, softmax_scale=softmax_scale,
                            flex_mask=flex_mask)
        fwd_start, fwd_end = spans.open("attn_fwd")
        bwd_start, bwd_end = spans.open("attn_bwd")
        query, key, value = _GradEvent.apply(bwd_end, query, key, value)
        fwd_start.record()
        out = dispatch(query, key, value, selected_token_ids, backend=backend, softmax_scale=softmax_scale,
                       flex_mask=flex_mask)
        fwd_end.record()
        (out,) = _GradEvent.apply(bwd_start, out)
        spans.routes = selected_token_ids
        spans.call = (tuple(query.shape), tuple(key.shape), query.dtype, softmax_scale,
                      [t.is_contiguous() for t in (query, key, value)])
        return out

    return qsa_gqa_attention


def timed_function(fn, spans: Spans, name: str):
    def wrapper(*args, **kwargs):
        if not spans.active:
            return fn(*args, **kwargs)
        start, end = spans.open(name)
        start.record()
        result = fn(*args, **kwargs)
        end.record()
        return result

    return wrapper
