"""Framework-neutral pieces of QSA shared by ``qsa_torch``, ``qsa_jax`` and ``parity``.

numpy only: the shape/scale half of the input contract, the route generators
and training layouts (so both frameworks see identical routes from one seed),
route overlap statistics (adjacent-row Jaccard, tile-union inflation), the
float64 oracle and the dispatchers' log-once rule (``log_once``). Nothing here imports
torch or jax.
"""

from .contract import ProblemDims, check_shapes, resolve_scale
from .generators import FAMILIES, qsa_width
from .layouts import LAYOUTS, RouteProblem, make_problem
from .route_stats import Tiling, adjacent_jaccard, route_stats, union_inflation

__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "ProblemDims",
    "RouteProblem",
    "Tiling",
    "adjacent_jaccard",
    "check_shapes",
    "make_problem",
    "qsa_width",
    "resolve_scale",
    "route_stats",
    "union_inflation",
]
