"""Hooks that route other libraries' models through ``qsa_torch``.

Each integration lives in its own module and imports its library on first use
only, so ``import qsa_torch.integrations`` needs nothing but ``qsa_torch``:

* :mod:`qsa_torch.integrations.nemo_automodel`: ``use_qsa_torch(model)`` for the
  Qwen3.8-Flash-Next QSA layers of NeMo Automodel.
"""
