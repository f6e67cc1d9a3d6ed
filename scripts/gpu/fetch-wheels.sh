#!/usr/bin/env bash
# Download the optional GPU runtimes as wheels for an offline CUDA host (Python 3.12, x86_64),
# for `QSA_WHEELS=DIR bash scripts/gpu/run.sh setup` there. Run on a machine that reaches the
# package index:
#
#   bash scripts/gpu/fetch-wheels.sh DIR
#
# Wheels (no dependencies: the host's image has torch, triton, jax, flax and transformers):
# jax-triton 0.3.1 (the JAX triton path; 0.4 needs triton >= 3.7), nemo-automodel 0.7.0 (the
# upstream layer), flash-attn-4 4.0.0b36 with the versions nemo-automodel 0.7.0 declares for
# its cute backend (nvidia-cutlass-dsl 4.6.2, quack-kernels 0.6.4, apache-tvm-ffi 0.1.11),
# and the cuDNN frontend 1.32.0.
#
# Environment: PY_VERSION (default 3.12) picks the host's Python; SPLIT_MB (unset: no split)
# cuts every wheel larger than that many MB into NAME.whl.part-aa, -ab, ... (for transfers
# with a size limit; `run.sh setup` joins them).
set -euo pipefail
out=${1:?usage: fetch-wheels.sh DIR}
mkdir -p "$out"
plat=(--only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pkgs=(jax-triton==0.3.1 nemo-automodel==0.7.0
      flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.6.2 nvidia-cutlass-dsl-libs-base==4.6.2
      nvidia-cutlass-dsl-libs-core==4.6.2 nvidia-cutlass-dsl-libs-cu13==4.6.2 "nvidia-cuda-nvdisasm>=13.3,<14"
      quack-kernels==0.6.4 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5 nvidia-cudnn-frontend==1.32.0)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out" "$p"
done
if [ -n "${SPLIT_MB:-}" ]; then
  for w in "$out"/*.whl; do
    if [ "$(stat -c %s "$w")" -gt $(( SPLIT_MB * 1000000 )) ]; then
      split -b "${SPLIT_MB}000000" "$w" "$w.part-" && rm "$w"
    fi
  done
fi
du -sh "$out"
