"""NeMo Automodel's Qwen3.8-Flash-Next QSA layers on ``qsa_torch`` kernels, in one call.

    from qsa_torch.integrations.nemo_automodel import use_qsa_torch

    handle = use_qsa_torch(model)          # every QSA layer of the model (or pass one layer)
    ...                                    # train as before
    handle.restore()                       # or: with use_qsa_torch(model): ...

Checked against nemo-automodel 0.7.0 (:data:`CHECKED_VERSIONS`). Another version is
accepted, with a warning on the ``qsa_torch`` logger, when it has the structure
described below; when it does not, :func:`use_qsa_torch` raises ``RuntimeError``
naming the installed version. nemo-automodel is imported on the first call, never
when this module is imported.

What upstream does (module ``nemo_automodel.components.models.qwen3_8_flash_next``):
``layers.Qwen3_8_FlashNextQSAAttention.forward`` gets its routes from
``self._select_routes`` (the frozen indexer under ``no_grad``, width trimmed to
``min(longest visible extent, indexer_budget + ratio - 1)``, int32, -1 padding, global
K/V coordinates; replayed instead of recomputed under activation checkpointing; on
CUDA with ``backend.attn == "flex"`` it also builds a FlexAttention mask over
``[B, S_q, S_kv]``), then calls the name ``qsa_gqa_attention`` that ``layers.py``
imported from ``qsa.py``::

    qsa_gqa_attention(query, key, value, selected_token_ids,
                      *, backend=self.backend.attn, softmax_scale=self.scaling, flex_mask=mask)

It always passes ``softmax_scale`` (``head_dim ** -0.5``). That dispatch sends CPU
tensors to its gathered oracle (any float dtype; IDs must be -1 or in range; a
duplicate ID counts twice, which the indexer never emits) and CUDA tensors to
FlexAttention (``"flex"``: BF16 only, reusing ``flex_mask``) or FA4 (``"cute"``: SM90,
BF16, D = 256); any other backend name raises on CUDA.

The hook is per layer, never process-global. For each chosen layer two instance
attributes shadow the class's methods: ``forward`` is upstream's own function (same
code object, defaults and closure) evaluated in a copy of ``layers.py``'s namespace in
which ``qsa_gqa_attention`` is the replacement dispatch, and ``_select_routes``
likewise with ``build_flex_qsa_mask`` returning ``None`` (the replacement never reads
the FlexAttention mask, so its ``[B, S_q, S_kv]`` table is not built). The module
``layers.py``, the class, other layers, parameters and the state dict are untouched;
``restore()`` deletes the attributes. The copied namespace is a snapshot taken
when the route is installed.

The route belongs to its handle and the layer objects it was installed on. Copies keep
the attributes but belong to no handle (and a copy of the handle owns nothing):
``copy.deepcopy`` of a routed layer (or model) gives one that still calls the same
dispatch, and one pickled (``torch.save``, then ``torch.load``) comes back with
upstream's own methods bound as the attributes. A handle itself cannot be pickled
(``TypeError``).
:func:`use_qsa_torch` on such a copy replaces the leftovers, and its handle's
``restore()`` removes them. The state dict never carries the route.

The replacement dispatch accepts exactly upstream's signature and ignores ``backend``
(upstream's kernel choice) and ``flex_mask``. With ``backend="auto"`` it leaves
non-CUDA tensors to upstream's own dispatch (CPU runs keep upstream's oracle) and
sends CUDA tensors to ``qsa_torch.sparse_gqa_attention(..., backend="auto")``; a
named backend (``"reference"``, ``"triton"``, ...) gets every call. The routes are
passed with ``route_format="qsa"``: the indexer emits four-token blocks plus the causal
tail, the QSA route format of docs/contract.md.

Under ``torch.compile`` the routed forward has no graph break at the attention call
(with routes replayed it compiles with ``fullgraph=True``); the layer's graph breaks
are upstream's: host syncs in its indexer (``qsa.py``: ``right_padded_sequence_lengths``,
``select_qsa_token_ids``) and, on CPU without a route, its oracle's ID check.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import logging
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qsa_common.quiet_import import quiet_import

from ..api import BACKENDS, sparse_gqa_attention

__all__ = [
    "CHECKED_VERSIONS",
    "AttentionRoute",
    "qsa_torch_dispatch",
    "route_qsa_attention",
    "use_qsa_torch",
]

logger = logging.getLogger("qsa_torch")

#: nemo-automodel versions whose layer this hook was read against and tested with.
CHECKED_VERSIONS = ("0.7.0",)

_LAYERS_MODULE = "nemo_automodel.components.models.qwen3_8_flash_next.layers"
_LAYER_CLASS = "Qwen3_8_FlashNextQSAAttention"
# method of the layer -> the global name it calls that the route rebinds
_DISPATCH_NAME = "qsa_gqa_attention"
_MASK_NAME = "build_flex_qsa_mask"
_HOOKED = {"forward": _DISPATCH_NAME, "_select_routes": _MASK_NAME}
# marks a function installed by route_qsa_attention
_MARK = "_qsa_attention_route"

_P = inspect.Parameter
# upstream's qsa_gqa_attention(query, key, value, selected_token_ids, *, backend,
# softmax_scale=None, flex_mask=None): names, kinds and defaults
_DISPATCH_SIGNATURE = (
    ("query", _P.POSITIONAL_OR_KEYWORD, _P.empty),
    ("key", _P.POSITIONAL_OR_KEYWORD, _P.empty),
    ("value", _P.POSITIONAL_OR_KEYWORD, _P.empty),
    ("selected_token_ids", _P.POSITIONAL_OR_KEYWORD, _P.empty),
    ("backend", _P.KEYWORD_ONLY, _P.empty),
    ("softmax_scale", _P.KEYWORD_ONLY, None),
    ("flex_mask", _P.KEYWORD_ONLY, None),
)


def _signature(fn: Callable) -> tuple:
    return tuple((p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values())


@dataclass(frozen=True)
class _Upstream:
    """The parts of nemo-automodel the route relies on, checked once per call."""

    version: str
    layer_class: type
    dispatch: Callable[..., torch.Tensor]


_WARNED_VERSIONS: set[str] = set()


def _installed_version() -> str:
    try:
        return importlib.metadata.version("nemo-automodel")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _upstream() -> _Upstream:
    """Import upstream's layer module and check that it has what the route rebinds.

    Raises:
        ImportError: nemo-automodel (or its Qwen3.8-Flash-Next model) is not installed.
        RuntimeError: the installed version lacks the layer class, its ``forward`` /
            ``_select_routes`` calls of the two global names, or the dispatch function
            with upstream 0.7.0's signature.
    """
    try:
        layers = quiet_import(_LAYERS_MODULE)  # upstream's import-time warnings are its own
    except ImportError as err:
        raise ImportError(
            "use_qsa_torch needs nemo-automodel with its Qwen3.8-Flash-Next model "
            f"(pip install 'qsa-kernels[upstream]', i.e. nemo-automodel=={CHECKED_VERSIONS[-1]}); "
            f"importing {_LAYERS_MODULE} failed: {err}"
        ) from err
    version = _installed_version()
    problems = []
    cls = getattr(layers, _LAYER_CLASS, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        problems.append(f"{_LAYERS_MODULE} has no module class {_LAYER_CLASS}")
    else:
        for method, name in _HOOKED.items():
            fn = cls.__dict__.get(method)
            if not isinstance(fn, types.FunctionType) or name not in fn.__code__.co_names:
                problems.append(f"{_LAYER_CLASS}.{method} does not call the global {name}")
    dispatch = getattr(layers, _DISPATCH_NAME, None)
    if not callable(dispatch):
        problems.append(f"{_LAYERS_MODULE} has no dispatch function {_DISPATCH_NAME}")
    elif _signature(dispatch) != _DISPATCH_SIGNATURE:
        problems.append(f"{_DISPATCH_NAME}{inspect.signature(dispatch)} is not the expected "
                        "(query, key, value, selected_token_ids, *, backend, softmax_scale=None, "
                        "flex_mask=None)")
    if problems:
        raise RuntimeError(
            f"use_qsa_torch does not know the installed nemo-automodel {version}: "
            + "; ".join(problems) + f" (checked against nemo-automodel {', '.join(CHECKED_VERSIONS)})"
        )
    if version not in CHECKED_VERSIONS and version not in _WARNED_VERSIONS:
        _WARNED_VERSIONS.add(version)
        logger.warning("use_qsa_torch: nemo-automodel %s has the expected layer and dispatch but was "
                       "not checked (checked: %s)", version, ", ".join(CHECKED_VERSIONS))
    return _Upstream(version, cls, dispatch)


def qsa_torch_dispatch(backend: str, fallback: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A drop-in for upstream's ``qsa_gqa_attention`` that runs ``qsa_torch``.

    Args:
        backend: ``"auto"`` or a name in ``qsa_torch.api.BACKENDS``.
        fallback: upstream's dispatch; ``"auto"`` hands it the non-CUDA calls.

    Returns:
        ``qsa_gqa_attention(query, key, value, selected_token_ids, *, backend,
        softmax_scale=None, flex_mask=None)`` with upstream's signature:
        query ``[B, S_q, Hq, D]``, key/value ``[B, S_kv, Hkv, D]`` (one float dtype and
        device), selected_token_ids ``[B, S_q, W]`` int32/int64 global K/V IDs
        (-1 padding); returns ``[B, S_q, Hq, D]`` in query's dtype. Its ``backend``
        (upstream's kernel choice) and ``flex_mask`` are not used.
    """
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    qsa_backend = backend

    def qsa_gqa_attention(query, key, value, selected_token_ids, *, backend, softmax_scale=None,
                          flex_mask=None):
        if qsa_backend == "auto" and not query.is_cuda:
            return fallback(query, key, value, selected_token_ids, backend=backend,
                            softmax_scale=softmax_scale, flex_mask=flex_mask)
        return sparse_gqa_attention(query, key, value, selected_token_ids, softmax_scale,
                                    backend=qsa_backend, route_format="qsa")

    return qsa_gqa_attention


def _no_flex_mask(selected_token_ids, *, kv_length, device):
    """Stands in for upstream's ``build_flex_qsa_mask`` when nothing reads the mask."""
    return None


def _rebound(fn: types.FunctionType, **names) -> types.FunctionType:
    """``fn`` (same code, defaults, closure) evaluated in a copy of its globals with ``names``."""
    namespace = dict(fn.__globals__)
    namespace.update(names)
    new = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    setattr(new, _MARK, True)
    return new


# layer -> the functions whose methods an active handle installed on it (copies of a layer
# are not keys; the values hold no reference to the layer, so a dropped layer is freed)
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, types.FunctionType]] = weakref.WeakKeyDictionary()


def _installed_by_active_handle(layer: torch.nn.Module, name: str, current) -> bool:
    function = _ACTIVE.get(layer, {}).get(name)
    return (function is not None and isinstance(current, types.MethodType) and current.__self__ is layer
            and current.__func__ is function)


class AttentionRoute:
    """Handle of an installed route; :meth:`restore` undoes it (also on ``with`` exit).

    Attributes:
        layers: the routed ``Qwen3_8_FlashNextQSAAttention`` modules.
        dispatch: the function their ``forward`` calls instead of upstream's.
    """

    def __init__(self, installed: list[tuple[torch.nn.Module, dict[str, types.MethodType]]],
                 dispatch: Callable[..., torch.Tensor]):
        self._installed = installed
        self.layers = tuple(layer for layer, _ in installed)
        self.dispatch = dispatch

    @property
    def active(self) -> bool:
        """Whether the route is still installed."""
        return bool(self._installed)

    def restore(self) -> None:
        """Give every routed layer its class's ``forward`` and ``_select_routes`` back.

        Idempotent. Raises ``RuntimeError`` (after restoring every other layer) for a
        layer whose instance attributes were replaced or removed by someone else since.
        """
        installed, self._installed = self._installed, []
        foreign = []
        for layer, methods in installed:
            if all(_installed_by_active_handle(layer, name, method) for name, method in methods.items()):
                del _ACTIVE[layer]
            for name, method in methods.items():
                if layer.__dict__.get(name) is method:
                    delattr(layer, name)
                else:
                    foreign.append(f"{type(layer).__name__}.{name}")
        if foreign:
            raise RuntimeError("AttentionRoute.restore: replaced since the route was installed, "
                               f"left as found: {', '.join(foreign)}")

    def __copy__(self) -> AttentionRoute:
        """A copy of a handle owns nothing (restored state): the route stays with this one."""
        return AttentionRoute([], self.dispatch)

    def __deepcopy__(self, memo) -> AttentionRoute:
        """As :meth:`__copy__`: layers copied beside it are leftovers no handle owns."""
        return self.__copy__()

    def __reduce__(self):
        """Refused: the route belongs to the layer objects of this process. Save the model
        instead (its routed layers load as leftovers to route again)."""
        raise TypeError("an AttentionRoute cannot be pickled: the route belongs to the layers it was "
                        "installed on in this process; save the model instead (torch.save), and call "
                        "use_qsa_torch on the loaded one")

    def __enter__(self) -> AttentionRoute:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "restored"
        return f"AttentionRoute({len(self.layers)} layer(s), {state})"


def _leftover(layer: torch.nn.Module, name: str, current, upstream: _Upstream) -> bool:
    """Whether instance attribute ``name`` is a route's copied remains: a method bound to
    ``layer`` itself of a routed function (``copy.deepcopy``) or of upstream's own
    (unpickled: pickle stores a bound method as ``getattr(layer, name)``)."""
    return (isinstance(current, types.MethodType) and current.__self__ is layer
            and (getattr(current.__func__, _MARK, False)
                 or current.__func__ is upstream.layer_class.__dict__[name]))


def _check_routable(layer: torch.nn.Module, upstream: _Upstream) -> None:
    for name in _HOOKED:
        current = layer.__dict__.get(name)
        if current is not None:
            if _installed_by_active_handle(layer, name, current):
                raise RuntimeError(f"{type(layer).__name__} (layer_idx {getattr(layer, 'layer_idx', '?')}) "
                                   "is already routed by an active handle; restore() it first")
            if not _leftover(layer, name, current, upstream):
                raise RuntimeError(f"{type(layer).__name__} has its own instance attribute {name!r}; "
                                   "cannot route its attention")
        if getattr(type(layer), name) is not getattr(upstream.layer_class, name):
            raise RuntimeError(f"{type(layer).__qualname__} overrides {name}; only upstream's "
                               f"{_LAYER_CLASS}.{name} can be routed")


def route_qsa_attention(
    model_or_layer: torch.nn.Module,
    dispatch: Callable[..., torch.Tensor],
    *,
    build_flex_mask: bool = False,
) -> AttentionRoute:
    """Make every Qwen3.8-Flash-Next QSA layer in ``model_or_layer`` call ``dispatch``.

    The mechanism of :func:`use_qsa_torch` (see the module docstring), for any
    replacement of upstream's ``qsa_gqa_attention``; the GPU benchmark uses it to time
    upstream's own dispatch inside the layer.

    Args:
        model_or_layer: a module that is, or contains, ``Qwen3_8_FlashNextQSAAttention``
            layers (a whole model, a decoder layer, one attention layer).
        dispatch: callable with upstream's signature ``(query [B,S_q,Hq,D],
            key [B,S_kv,Hkv,D], value [B,S_kv,Hkv,D], selected_token_ids int [B,S_q,W],
            *, backend: str, softmax_scale: float | None = None, flex_mask=None)``
            returning ``[B, S_q, Hq, D]`` in query's dtype.
        build_flex_mask: keep upstream's FlexAttention mask build (on CUDA with
            ``backend.attn == "flex"``) for a ``dispatch`` that reads ``flex_mask``;
            by default the layer passes ``flex_mask=None``.

    Returns:
        An :class:`AttentionRoute` (a context manager) whose ``restore()`` undoes it.

    Raises:
        TypeError: ``model_or_layer`` is not a module or ``dispatch`` not callable.
        ValueError: no QSA layer in ``model_or_layer``.
        ImportError / RuntimeError: see :func:`use_qsa_torch`.
    """
    return _route(model_or_layer, dispatch, build_flex_mask, _upstream())


def _route(model_or_layer, dispatch, build_flex_mask: bool, upstream: _Upstream) -> AttentionRoute:
    """:func:`route_qsa_attention` with upstream's layer module already checked."""
    if not isinstance(model_or_layer, torch.nn.Module):
        raise TypeError(f"model_or_layer must be a torch.nn.Module, got {type(model_or_layer).__name__}")
    if not callable(dispatch):
        raise TypeError(f"dispatch must be callable, got {type(dispatch).__name__}")
    targets = [m for m in model_or_layer.modules() if isinstance(m, upstream.layer_class)]
    if not targets:
        raise ValueError(f"{type(model_or_layer).__name__} contains no {_LAYER_CLASS} layer")
    for layer in targets:
        _check_routable(layer, upstream)
    functions = {"forward": _rebound(upstream.layer_class.forward, **{_DISPATCH_NAME: dispatch})}
    if not build_flex_mask:
        functions["_select_routes"] = _rebound(upstream.layer_class._select_routes,
                                               **{_MASK_NAME: _no_flex_mask})
    installed = []
    for layer in targets:
        methods = {name: types.MethodType(fn, layer) for name, fn in functions.items()}
        for name, method in methods.items():
            setattr(layer, name, method)
        _ACTIVE[layer] = functions
        installed.append((layer, methods))
    return AttentionRoute(installed, dispatch)


def use_qsa_torch(model_or_layer: torch.nn.Module, backend: str = "auto") -> AttentionRoute:
    """Route the sparse GQA of every Qwen3.8-Flash-Next QSA layer through ``qsa_torch``.

    Each ``Qwen3_8_FlashNextQSAAttention`` in ``model_or_layer`` then computes its
    attention with ``qsa_torch.sparse_gqa_attention(q, k, v, routes, scale,
    backend=backend, route_format="qsa")`` (``"auto"``: CUDA tensors only; CPU keeps
    upstream's oracle) and stops building upstream's FlexAttention mask. Everything
    else in the layer (projections, norms, RoPE, the indexer, route replay under
    activation checkpointing, CP gathers, padded and packed layouts) is upstream's.
    Install before ``torch.compile`` / FSDP wrapping or after; the route shadows the
    methods on the layer objects themselves.

    Args:
        model_or_layer: a module that is, or contains, QSA attention layers.
        backend: ``"auto"`` (default) or one of ``"reference"``, ``"flex"``, ``"fa4"``,
            ``"cudnn"``, ``"triton"`` (``qsa_torch.api.BACKENDS``).

    Returns:
        An :class:`AttentionRoute`; ``restore()`` (idempotent) or leaving its ``with``
        block puts upstream's attention back.

    Raises:
        ValueError: unknown ``backend``; no QSA layer in ``model_or_layer``.
        TypeError: ``model_or_layer`` is not a module.
        ImportError: nemo-automodel is not installed.
        RuntimeError: the installed nemo-automodel lacks the expected layer class or
            dispatch (message names its version); a layer is already routed by an
            active handle (no nesting: restore first) or carries its own override.
    """
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    upstream = _upstream()
    route = _route(model_or_layer, qsa_torch_dispatch(backend, upstream.dispatch), False, upstream)
    logger.info("use_qsa_torch: %d %s layer(s) use qsa_torch.sparse_gqa_attention(backend=%r)",
                len(route.layers), _LAYER_CLASS, backend)
    return route
