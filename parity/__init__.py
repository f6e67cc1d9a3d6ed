"""Cross-framework parity for QSA: the only package that imports both qsa_torch and qsa_jax.

* ``python -m parity``: every backend of both frameworks on identical numpy inputs,
  compared with a float64 oracle and with each other (:mod:`parity.suite`,
  report in :mod:`parity.report`, backends in :mod:`parity.backends`).
* ``python -m parity.bench``: the side-by-side benchmark against dense causal
  attention (:mod:`parity.bench`).

Importing this package imports neither framework; each backend is imported on
first use.
"""
