#!/usr/bin/env bash
# The GPU runner: every check and benchmark that docs/benchmarks.md quotes, by phase.
#
#   bash scripts/gpu/run.sh PHASE [PHASE ...]      (from anywhere; it runs in the repository root)
#
# Phases:
#   setup       install the optional runtimes (jax-triton, nemo-automodel, flash-attn-4 and the
#               CuTe DSL, cuDNN frontend) from the wheels in $QSA_WHEELS into $QSA_SITE, offline
#   check       correctness, no timing, steps side by side: the parity matrix of both frameworks'
#               default CUDA path, the GPU tests, bitwise repeatability under load, the per-backend
#               checks, compute-sanitizer memcheck, the CP wrapper on one rank (on two GPUs or
#               more: the CP check across GPUs and the Flax layer's CP cases too)
#   bench       timing, each step alone: (24,2) and (12,1) beside dense causal attention across
#               S and route overlap (python -m parity.bench), then the deterministic backward
#   lowoverlap  timing, each step alone: random routes (the bottom of the overlap range) beside
#               QSA routes and dense causal attention
#   layer       the layers: nemo-automodel's layer with our kernels against upstream's flex and
#               cute backends (one training step), and the Flax port against the upstream layer
#   soak        long runs: training-like steps over changing shapes, S=262144, inputs past 2**31
#               elements, the reliability tests
#   all         setup (when $QSA_WHEELS is set), check, bench, lowoverlap, layer, soak
#
# Environment (all optional):
#   OUT             where results go (default gpu-out, relative to the repository root); each
#                   phase writes $OUT/<phase>/: one <step>.log per step, the step's own reports
#                   under <step>/, environment.log (versions) and steps.log (exit status and
#                   seconds of every step)
#   QSA_WHEELS      folder of wheels for `setup` (scripts/gpu/fetch-wheels.sh makes one on a
#                   machine that reaches the package index); a wheel split into NAME.whl.part-*
#                   pieces is joined first
#   QSA_SITE        where `setup` installs them and every phase looks for them
#                   (default /tmp/qsa-site; `setup` writes $QSA_SITE/env.sh)
#   PYTHON          the interpreter (default python3)
#   QSA_DRY_RUN=1   print each step's command instead of running it (no GPU needed)
#
# Exit status: 0 when every step of every phase exited 0, else 1 (steps.log says which).
set -u
cd "$(dirname "$0")/../.."
root=$PWD
OUT=${OUT:-gpu-out}
case $OUT in /*) ;; *) OUT=$root/$OUT ;; esac
QSA_SITE=${QSA_SITE:-/tmp/qsa-site}
PY=${PYTHON:-python3}
DRY=${QSA_DRY_RUN:-0}
failed=0

usage() { sed -n '2,/^set -u$/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# env for every step: this checkout first, then the optional runtimes when installed
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export PYTHONPATH=$root:$QSA_SITE:$QSA_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}

# step NAME LIMIT_S CMD...: run CMD alone under a time limit, its output in $R/NAME.log
step() {
  local name=$1 limit=$2 t0 rc
  shift 2
  if [ "$DRY" = 1 ]; then echo "[$phase] $name (limit ${limit}s): $(printf '%q ' "$@")"; return 0; fi
  t0=$(date +%s)
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >> "$R/steps.log"
  [ "$rc" = 0 ] || echo "FAILED $name rc=$rc" >> "$R/steps.log"
}
# beside NAME LIMIT_S CMD...: the same in the background (wait collects them)
beside() { step "$@" & }

# needs MODULE NAME: true when MODULE imports; else records NAME as skipped (an optional runtime)
needs() {
  [ "$DRY" = 1 ] && return 0
  "$PY" -c "import $1" > /dev/null 2>&1 && return 0
  echo "$2 skipped: $1 does not import (install it with the setup phase)" >> "$R/steps.log"
  return 1
}

gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true; }

environment() {
  [ "$DRY" = 1 ] && return 0
  "$PY" - > "$R/environment.log" 2>&1 <<'PY'
import importlib, platform, subprocess
print("python", platform.python_version())
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
for m in ("torch", "triton", "jax", "jaxlib", "flax", "jax_triton", "flash_attn.cute", "cudnn", "nemo_automodel"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:
        print(m, "unavailable:", type(e).__name__, e)
PY
}

setup() {
  if [ -z "${QSA_WHEELS:-}" ]; then echo "setup: QSA_WHEELS is not set (a folder of wheels)" >&2; return 1; fi
  if [ "$DRY" = 1 ]; then echo "[setup] pip install --no-index --no-deps --target $QSA_SITE $QSA_WHEELS/*.whl"; return 0; fi
  local parts w
  for parts in "$QSA_WHEELS"/*.whl.part-aa; do
    [ -e "$parts" ] || continue
    w=${parts%.part-aa}
    [ -e "$w" ] || cat "$w".part-* > "$w"
  done
  step pip 600 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$QSA_SITE" "$QSA_WHEELS"/*.whl
  grep -q '^FAILED pip' "$R/steps.log" && return 1
  printf 'export PYTHONPATH=%s:%s/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}\n' \
    "$QSA_SITE" "$QSA_SITE" > "$QSA_SITE/env.sh"
}

check() {
  beside parity 470 "$PY" scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 440 --parity-args "--backends triton,jax-triton"
  beside kernel_tests 470 "$PY" -m pytest -q -p no:cacheprovider tests/test_forward_sm90.py \
    tests/test_backward_sm90.py tests/test_triton_qsa.py tests/test_triton_deterministic.py \
    tests/test_jax_triton.py tests/test_torch_api.py
  beside layer_tests 470 "$PY" -m pytest -q -p no:cacheprovider tests/test_nemo_automodel_integration.py \
    tests/test_layers.py tests/test_context_parallel.py tests/test_validation.py tests/test_pallas_qsa.py \
    tests/test_flex_qsa.py
  beside stress 470 "$PY" scripts/gpu/stress_bitwise.py --out "$R/stress" --budget-s 420
  beside cp_one_rank 200 "$PY" scripts/gpu/check_cp_one_rank.py
  beside sanitize_triton 300 compute-sanitizer --tool memcheck --print-limit 30 \
    "$PY" scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_deterministic 300 "$PY" scripts/gpu/bench_deterministic.py --out "$R/sanitize_deterministic" \
    --sanitizer --sanitizer-timeout 280
  beside sanitize_jax 300 "$PY" scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation triton \
    --timeout-s 290
  wait
  # the per-backend checks, side by side once the steps above are done
  needs jax_triton check_jax_triton && beside check_jax_triton 300 "$PY" scripts/gpu/check_jax_triton.py \
    --out "$R/check_jax_triton" --budget-s 240
  beside check_flex 300 "$PY" scripts/gpu/check_flex.py --out "$R/check_flex" --budget-s 240
  needs flash_attn.cute check_fa4 && beside check_fa4 300 "$PY" scripts/gpu/check_fa4.py --out "$R/check_fa4"
  needs cudnn check_cudnn && beside check_cudnn 200 "$PY" scripts/gpu/check_cudnn.py --out "$R/check_cudnn"
  wait
  if [ "$DRY" = 1 ] || [ "$(gpus)" -ge 2 ]; then
    step check_cp 300 "$PY" scripts/gpu/check_cp.py --out "$R/check_cp"
    step layer_cp 600 "$PY" scripts/gpu/layer_parity.py --out "$R/layer_cp" --seq-lens 8192 \
      --layouts cp,cp-packed --time-budget 540
  fi
}

bench() {
  step bench_24x2 600 "$PY" -m parity.bench --heads 24:2 --seq-lens 8192,131072 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.6,0.8,0.9 --backends torch-dense-sdpa,triton,jax-triton --time-budget 160 \
    --out "$R/bench_24x2"
  step bench_12x1 300 "$PY" -m parity.bench --heads 12:1 --seq-lens 8192 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.8 --backends torch-dense-sdpa,triton,jax-triton --time-budget 90 \
    --out "$R/bench_12x1"
  step deterministic 200 "$PY" scripts/gpu/bench_deterministic.py --out "$R/deterministic"
}

lowoverlap() {
  step random_24x2 600 "$PY" -m parity.bench --heads 24:2 --seq-lens 8192,32768 --families random \
    --overlaps 0.8 --backends torch-dense-sdpa,triton,jax-triton --time-budget 270 --out "$R/random_24x2"
  step random_12x1 300 "$PY" -m parity.bench --heads 12:1 --seq-lens 32768 --families random \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 140 --out "$R/random_12x1"
}

layer() {
  needs nemo_automodel layer || return 0
  step nemo_layer 480 "$PY" scripts/gpu/bench_nemo_layer.py --out "$R/nemo_layer" --seq-lens 32768 \
    --hidden-rho 0 0.9 0.99 --variants qsa_torch flex cute --time-budget 360 --cute-preprocess eager \
    --stack-dump-s 120
  step flax_layer_8192 300 "$PY" scripts/gpu/layer_parity.py --out "$R/flax_layer_8192" --seq-lens 8192 \
    --layouts padded,packed --time-budget 200
  step flax_layer_32768_padded 300 "$PY" scripts/gpu/layer_parity.py --out "$R/flax_layer_32768_padded" \
    --seq-lens 32768 --layouts padded --time-budget 250
  step flax_layer_32768_packed 300 "$PY" scripts/gpu/layer_parity.py --out "$R/flax_layer_32768_packed" \
    --seq-lens 32768 --layouts packed --time-budget 250
}

soak() {
  step soak 330 "$PY" scripts/gpu/soak.py --out "$R/soak" --budget-s 280
  step long_context 330 "$PY" scripts/gpu/long_context.py --out "$R/long_context" --budget-s 280
  step large_offsets_torch 300 "$PY" scripts/gpu/check_large_offsets.py --framework torch --budget-s 260 \
    --out "$R/large_offsets_torch.json"
  step large_offsets_jax 300 "$PY" scripts/gpu/check_large_offsets.py --framework jax --budget-s 260 \
    --out "$R/large_offsets_jax.json"
  step reliability_tests 450 "$PY" -m pytest -q -s -p no:cacheprovider tests/test_reliability_gpu.py
}

[ $# -gt 0 ] || { usage; exit 2; }
phases=()
for p in "$@"; do
  case $p in
    all) [ -n "${QSA_WHEELS:-}" ] && phases+=(setup); phases+=(check bench lowoverlap layer soak) ;;
    setup|check|bench|lowoverlap|layer|soak) phases+=("$p") ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown phase: $p" >&2; usage >&2; exit 2 ;;
  esac
done
for phase in "${phases[@]}"; do
  R=$OUT/$phase
  [ "$DRY" = 1 ] || { mkdir -p "$R" && : > "$R/steps.log"; }
  environment
  "$phase" || failed=1
  if [ "$DRY" != 1 ] && grep -q '^FAILED' "$R/steps.log"; then failed=1; fi
  [ "$DRY" = 1 ] || { echo "== $phase"; cat "$R/steps.log"; }
done
exit $failed
