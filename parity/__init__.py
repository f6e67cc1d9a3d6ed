"""Cross-framework parity for QSA: the only package that imports both qsa_torch and qsa_jax."""
