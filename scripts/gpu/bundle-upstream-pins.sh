#!/usr/bin/env bash
# The GPU wheel bundle with the versions nemo-automodel 0.7.0 declares for its FA4 ("cute")
# QSA backend (its extras pin nvidia-cutlass-dsl==4.6.2, apache-tvm-ffi<=0.1.11,
# quack-kernels==0.6.4), for measuring upstream's cute layer (docs/benchmarks.md: with the
# shared bundle's cutlass-dsl 4.8.1 its first training step did not finish in 373 s).
# Same layout and installer as ../shared/gpu/bundle-wheels.sh, which it replaces in .gpu/:
# run in the project root, then carry .gpu/a + .gpu/install.sh, and .gpu/b + .gpu/install.sh
# in the next call, on a fresh machine (one that installed the shared bundle already keeps it:
# its /tmp/qsa-site wins). Not yet tried on the GPU host.
set -euo pipefail
root=$(pwd)
out=$root/.gpu
shared=$(cd "$(dirname "$0")/../../../shared/gpu" && pwd)
rm -rf "$out"
mkdir -p "$out/a" "$out/b" "$out/dl"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# --no-deps everywhere (the host is offline): libs-base 4.6.2 needs libs-core 4.6.2 and
# nvidia-cuda-nvdisasm; its cuda-python requirement is met by the host's cuda-bindings
# (the DSL imports cuda.bindings only)
pkgs=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.6.2 nvidia-cutlass-dsl-libs-base==4.6.2
      nvidia-cutlass-dsl-libs-core==4.6.2 nvidia-cutlass-dsl-libs-cu13==4.6.2 "nvidia-cuda-nvdisasm>=13.3,<14"
      quack-kernels==0.6.4 apache-tvm-ffi==0.1.11 torch-c-dlpack-ext==0.1.5 nvidia-cudnn-frontend==1.32.0
      jax-triton==0.3.1)
for p in "${pkgs[@]}"; do
  python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/dl" "$p"
done
big=$(ls "$out"/dl/nvidia_cutlass_dsl_libs_cu13-*.whl)
for w in "$out"/dl/*.whl; do
  case $(basename "$w") in
    nvidia_cutlass_dsl_libs_cu13-*) ;;
    nvidia_cuda_nvdisasm-*) cp "$w" "$out/b/" ;;  # keeps part a (plus .whl/) under one carry's 64 MiB
    *) cp "$w" "$out/a/" ;;
  esac
done
( cd "$out/dl" && md5sum "$(basename "$big")" > "$out/a/big.md5" )
split -b 36000000 "$big" "$out/dl/big.part-"
mv "$out/dl/big.part-aa" "$out/a/"
mv "$out"/dl/big.part-a[b-z] "$out/b/"
cp "$shared/install-wheels.sh" "$out/install.sh"
du -sh "$out/a" "$out/b"
echo "upstream-pinned bundle ready in .gpu/ (carry .gpu/a, then .gpu/b, each with .gpu/install.sh)"
