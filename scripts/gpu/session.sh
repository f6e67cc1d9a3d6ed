#!/usr/bin/env bash
# One H200 session's worth of GPU checks and benchmarks, in three calls of < 10 minutes on a
# warm machine (docs/benchmarks.md quotes what each produced). From the repository root:
#
#   call 1 (carry .gpu/a .gpu/install.sh .whl):  bash scripts/gpu/session.sh bench
#   call 2 (carry .gpu/b .gpu/install.sh .whl):  bash scripts/gpu/session.sh timing
#   call 3 (no carry needed on a warm machine):  bash scripts/gpu/session.sh correctness
#   after fixes (carry .whl):                     bash scripts/gpu/session.sh recheck
#   FA4 in the layer bench (call A: carry .gpu/a .gpu/install.sh .whl, run bash .gpu/install.sh;
#   call B: carry .gpu/b .gpu/install.sh .whl):  bash scripts/gpu/session.sh fa4
#   kernels changed since the last timing (warm): bash scripts/gpu/session.sh verify
#   tile heights across overlap (warm):           bash scripts/gpu/session.sh tiles
#   which tilings read out of bounds (warm):      bash scripts/gpu/session.sh chunks
#   the backward's dK/dV atomics' cost (warm):    bash scripts/gpu/session.sh atomics
#   the Hopper backward's adds alone, beside it (warm): bash scripts/gpu/session.sh adds
#   a kernel change, in one call (carry .whl):    bash scripts/gpu/session.sh spot
#   Nsight Compute of both kernels (warm):        bash scripts/gpu/session.sh profile
#   main's whole GPU check, no timing (carry .whl): bash scripts/gpu/session.sh complete
#     (also the layers', integrations' and CP tests, and the one-rank NCCL CP check)
#   the side-by-side timing, both head configs (carry .whl): bash scripts/gpu/session.sh final
#   the same without the forward probe, then the deterministic probe (carry .whl): bash scripts/gpu/session.sh sweep
#   torch's host time per step, S=8192 beside dense (carry .whl): bash scripts/gpu/session.sh host
#   the bottom of the overlap range, random routes beside dense (carry .whl): bash scripts/gpu/session.sh lowoverlap
#   the Hopper forward against forward.py (carry .whl):    bash scripts/gpu/session.sh sm90fwd
#   the Hopper backward against backward.py (carry .whl):  bash scripts/gpu/session.sh sm90bwd
#   both Hopper kernels against forward.py / backward.py (carry .whl): bash scripts/gpu/session.sh sm90next, then sm90check
#   a kernel change's whole check and timing in one call (carry .whl): bash scripts/gpu/session.sh adopt
#   torch against JAX bit for bit where the Hopper kernels run (carry .whl): bash scripts/gpu/session.sh bitwise
#   bitwise repeatability under load, and the Flax layer at S=32768 (carry .whl): bash scripts/gpu/session.sh race
#   JAX Pallas' default tiles timed beside triton and dense (carry .whl): bash scripts/gpu/session.sh pallastime
#   JAX Pallas' default tiles checked (carry .whl):        bash scripts/gpu/session.sh pallascheck
#   this tree's Hopper kernels beside another commit's (git worktree add --detach .base REF; carry .base .whl):
#                                                          bash scripts/gpu/session.sh sm90ab
#   the same for the backward alone, with its GPU tests and the step beside dense (carry .base .whl):
#                                                          bash scripts/gpu/session.sh bwdab
#   the same for the forward alone (carry .base .whl):    bash scripts/gpu/session.sh fwdab
#   this tree's route unions beside .base's, memcheck and the Triton tests (carry .base .whl):
#                                                          bash scripts/gpu/session.sh unionab
#   the adds alone on fewer SMs, then unionab's timing and tests without memcheck (carry .base .whl):
#                                                          bash scripts/gpu/session.sh redcap
#
# .gpu/ comes from ../shared/gpu/bundle-wheels.sh (FA4, cuDNN frontend, jax-triton 0.3.1);
# .whl/ holds nemo-automodel 0.7.0 and jax-triton 0.3.1 wheels (pip download --no-deps), the
# only packages the upstream layer and the JAX triton path need beyond the host's image.
# Timing steps run alone on the GPU; correctness steps run side by side (their times are
# not quoted). Every step has a
# time limit and logs to <phase>/<step>.log in a scratch directory; $OUT/<phase>.tgz is
# repacked after every step, so a call cut short still brings back every finished step in
# one file (the device returns only a few files per call).
set -u
phase=${1:?bench, timing, correctness, fa4, verify, tiles, chunks, atomics, adds, spot, profile, complete, final, sweep, lowoverlap, host, sm90fwd, sm90bwd, sm90next, sm90check, sm90ab, bwdab, fwdab, unionab, redcap, adopt, bitwise, race, pallastime, pallascheck or recheck}
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
scratch=$(mktemp -d)
R=$scratch/$phase
mkdir -p "$R"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -d .gpu ] && bash .gpu/install.sh > "$R/install.log" 2>&1
[ -f /tmp/qsa-site/env.sh ] && source /tmp/qsa-site/env.sh
if [ -d .whl ] && [ ! -d /tmp/qsa-extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/qsa-extra .whl/*.whl \
    > "$R/pip.log" 2>&1
fi
export PYTHONPATH=$root:/tmp/qsa-extra${PYTHONPATH:+:$PYTHONPATH}
T0=$(date +%s)
# $OUT/<phase>.tgz from what the phase has written so far (written aside, then renamed: steps
# running side by side stamp concurrently)
pack() { local part; part=$(mktemp "$OUT/.$phase.XXXXXX") && tar czf "$part" -C "$scratch" "$phase" && mv -f "$part" "$OUT/$phase.tgz"; }
stamp() { echo "$1 rc=$2 at $(( $(date +%s) - T0 ))s" >> "$R/steps.log"; pack; }
alone() { local name=$1 limit=$2; shift 2; timeout "$limit" "$@" > "$R/$name.log" 2>&1; stamp "$name" $?; }
beside() { local name=$1 limit=$2; shift 2; ( timeout "$limit" "$@" > "$R/$name.log" 2>&1; stamp "$name" $? ) & }
# compute-sanitizer memcheck of the three probes (torch Triton, the deterministic backward, JAX
# triton), side by side
memcheck_all() {
  beside sanitize_triton 300 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_det 240 python3 scripts/gpu/probe_deterministic.py --out "$R/sanitize_det" --sanitizer --sanitizer-timeout 220
  beside sanitize_jax 300 python3 scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation triton \
    --timeout-s 290
}
# the side-by-side timing, each step alone: (24,2) across S and overlap, then (12,1)
side_by_side() {
  alone bench 200 python3 -m parity.bench --heads 24:2 --seq-lens 8192,131072 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.6,0.8,0.9 --backends torch-dense-sdpa,triton,jax-triton --time-budget 160 --out "$R/bench"
  alone bench_12x1 120 python3 -m parity.bench --heads 12:1 --seq-lens 8192 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.8 --backends torch-dense-sdpa,triton,jax-triton --time-budget 90 --out "$R/bench_12x1"
}
# the A/B phases' tail: the step beside dense at S=32768 (J 0.3, 0.8) and 131072 alone, then
# the kernel's GPU tests ($1) and both frameworks' Triton tests
step_and_tests() {
  alone bench 120 python3 -m parity.bench --heads 24:2 --seq-lens 131072 --overlaps 0.8 --overlaps-at 32768=0.3,0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 100 --out "$R/bench"
  beside gpu_tests 260 python3 -m pytest -q -p no:cacheprovider "$1" tests/test_jax_triton.py tests/test_triton_qsa.py \
    tests/test_torch_api.py
  wait
}
python3 - > "$R/environment.log" 2>&1 <<'PY'
import importlib, platform, subprocess
print(platform.python_version(), subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout)
for m in ("torch", "triton", "jax", "flax", "jax_triton", "flash_attn.cute", "nemo_automodel"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "ok"))
    except Exception as e:
        print(m, "unavailable:", e)
PY
case $phase in
bench)
  alone bench 430 python3 -m parity.bench --heads 24:2 --seq-lens 8192,131072 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.6,0.8,0.9 --backends torch-dense-sdpa,jax-dense-cudnn,triton,jax-triton,jax-pallas \
    --time-budget 300 --out "$R/bench"
  ;;
timing)
  alone probe_deterministic 140 python3 scripts/gpu/probe_deterministic.py --out "$R/probe_deterministic"
  alone nemo 220 python3 scripts/gpu/bench_nemo_layer.py --out "$R/nemo" --time-budget 140
  beside layer 175 python3 scripts/gpu/layer_parity.py --out "$R/layer" --seq-lens 8192 --time-budget 120
  beside jax_triton 170 python3 scripts/gpu/check_jax_triton.py --out "$R/jax_triton" --budget-s 110
  wait
  ;;
correctness)
  beside parity 430 python3 scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 380 --parity-args "--backends triton,jax-triton,jax-pallas"
  beside reliability 430 python3 -m pytest -q -s -p no:cacheprovider tests/test_reliability_gpu.py
  beside gpu_tests 430 python3 -m pytest -q -p no:cacheprovider tests/test_triton_qsa.py tests/test_torch_api.py \
    tests/test_triton_deterministic.py tests/test_jax_triton.py tests/test_nemo_automodel_integration.py \
    tests/test_flex_qsa.py
  beside check_triton 300 python3 scripts/gpu/check_triton.py --out "$R/check_triton"
  beside long_context 280 bash -c "cd scripts/gpu && python3 long_context.py --out '$R/long_context'"
  beside sanitize_jax 430 python3 scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation triton,pallas \
    --timeout-s 400
  beside soak 330 python3 scripts/gpu/soak.py --out "$R/soak" --budget-s 280
  beside sanitize_det 240 python3 scripts/gpu/probe_deterministic.py --out "$R/sanitize_det" --sanitizer
  wait
  ;;
fa4)
  # upstream's cute (FA4) layer beside ours and flex, both S in one run (needs .gpu/a then .gpu/b
  # installed: carry .gpu/b .gpu/install.sh .whl; FA4's JIT takes ~10 s of the first step). Its
  # route preprocessing runs eager: compiled, ptxas was still on its Inductor kernels after 4 min
  alone nemo 520 python3 scripts/gpu/bench_nemo_layer.py --out "$R/nemo" --seq-lens 8192 32768 --time-budget 400 \
    --cute-preprocess eager --stack-dump-s 120
  ;;
verify)
  # the kernels after CPU-only changes: timing alone first, then the GPU tests side by side
  alone bench 190 python3 -m parity.bench --heads 24:2 --seq-lens 8192,131072 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.6,0.8,0.9 --backends torch-dense-sdpa,triton,jax-triton --time-budget 150 --out "$R/bench"
  alone forward_sm90 150 python3 scripts/gpu/probe_forward_sm90.py --out "$R/forward_sm90" --budget-s 130
  beside gpu_tests 330 python3 -m pytest -q -p no:cacheprovider tests/test_forward_sm90.py tests/test_triton_qsa.py \
    tests/test_triton_deterministic.py tests/test_jax_triton.py tests/test_torch_api.py tests/test_flex_qsa.py \
    tests/test_pallas_qsa.py
  beside sanitize_triton 240 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_det 240 python3 scripts/gpu/probe_deterministic.py --out "$R/sanitize_det" --sanitizer --sanitizer-timeout 220
  beside parity 240 python3 scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 210 --parity-args "--backends triton,jax-triton"
  wait
  ;;
tiles)
  # tile heights across overlap (issue 18): warm machine, no carry needed
  alone tiles 420 python3 scripts/gpu/probe_tiles.py --out "$R/tiles" --budget-s 390
  ;;
chunks)
  # each configuration of probe_chunks.py under compute-sanitizer memcheck, side by side
  alone chunks 200 python3 scripts/gpu/probe_chunks.py --out "$R/chunks" --timeout-s 170
  ;;
atomics)
  # the backward kernel with and without its dK/dV adds' memory traffic (issue 18)
  alone atomics 200 python3 scripts/gpu/probe_atomics.py --out "$R/atomics" --budget-s 170
  ;;
adds)
  # the Hopper backward's dK/dV adds alone (a floor under its time), beside the kernel itself, at
  # S=32768 J 0.8 / 0.3 and S=131072 J 0.8, each step alone (warm, no carry needed)
  alone red_rate 150 python3 scripts/gpu/probe_red_rate.py --out "$R/red_rate" --seq-lens 32768 --overlaps 0.8 0.3
  alone red_rate_131072 150 python3 scripts/gpu/probe_red_rate.py --out "$R/red_rate_131072" --seq-lens 131072 \
    --overlaps 0.8
  alone backward 200 python3 scripts/gpu/probe_backward_sm90.py --out "$R/backward" --skip-checks \
    --seq-lens 32768 131072 --overlaps 0.8 0.3 --budget-s 170
  ;;
spot)
  # a kernel change checked in one call: timing at J 0.8 alone, then both frameworks' sanitizer
  # probes and the Flax layer against upstream's at S=32768 side by side
  alone bench 130 python3 -m parity.bench --heads 24:2 --seq-lens 8192 --overlaps 0.8 --overlaps-at 32768=0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 100 --out "$R/bench"
  beside sanitize_triton 200 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_jax 200 python3 scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation triton \
    --timeout-s 190
  beside layer 230 python3 scripts/gpu/layer_parity.py --out "$R/layer" --seq-lens 32768 --layouts padded \
    --time-budget 220
  wait
  ;;
profile)
  # one step's forward and backward kernels under Nsight Compute (full set, SASS-level stall
  # samples); the report's text pages come back, the .ncu-rep too
  alone ncu 240 ncu --profile-from-start off --set full --import-source yes \
    --kernel-name regex:"qsa_(forward|backward)(_sm90)?_kernel" -o "$R/prof" python3 scripts/gpu/profile_kernels.py
  alone details 60 ncu --import "$R/prof.ncu-rep" --page details
  alone source 120 bash -c "ncu --import '$R/prof.ncu-rep' --page source --csv --print-source sass | gzip > '$R/source.csv.gz'"
  ;;
complete)
  # no timing: the whole parity matrix of both frameworks' default CUDA path (every layout, both
  # head configurations) with the budget it needs, beside the GPU tests and memcheck
  beside parity 470 python3 scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 440 --parity-args "--backends triton,jax-triton"
  beside gpu_tests 470 python3 -m pytest -q -p no:cacheprovider tests/test_forward_sm90.py tests/test_backward_sm90.py \
    tests/test_triton_qsa.py tests/test_triton_deterministic.py tests/test_jax_triton.py tests/test_torch_api.py
  beside stress 470 python3 scripts/gpu/stress_bitwise.py --out "$R/stress" --budget-s 420
  beside layer_tests 470 python3 -m pytest -q -p no:cacheprovider tests/test_nemo_automodel_integration.py \
    tests/test_layers.py tests/test_context_parallel.py tests/test_validation.py tests/test_pallas_qsa.py
  beside cp_one_rank 200 python3 scripts/gpu/check_cp_one_rank.py
  memcheck_all
  wait
  ;;
race)
  # bitwise repeatability under load: torch and JAX (against torch) each repeating their cases
  # beside the Flax layer against upstream's at S=32768 (packed, the route check's rounding rule)
  beside stress_jax 330 python3 scripts/gpu/stress_bitwise.py --out "$R/stress_jax" --jax --budget-s 280
  beside stress 330 python3 scripts/gpu/stress_bitwise.py --out "$R/stress" --budget-s 280
  beside layer 330 python3 scripts/gpu/layer_parity.py --out "$R/layer" --seq-lens 32768 --layouts packed \
    --time-budget 280
  wait
  ;;
adopt)
  # a kernel change in one call: complete's checks side by side (the parity matrix of both
  # frameworks, the kernels' GPU tests, memcheck), then alone the side-by-side timing at
  # S=8192 / 32768 (J 0.3, 0.8) / 131072, the deterministic backward's probe and the union
  # recipes against each other up to the rank recipe's limit (S_kv = 16 * rows * K) and past it
  beside parity 300 python3 scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 270 --parity-args "--backends triton,jax-triton"
  beside gpu_tests 330 python3 -m pytest -q -p no:cacheprovider tests/test_backward_sm90.py \
    tests/test_triton_deterministic.py tests/test_jax_triton.py tests/test_torch_api.py tests/test_triton_qsa.py
  memcheck_all
  wait
  alone bench 150 python3 -m parity.bench --heads 24:2 --seq-lens 8192,131072 --overlaps 0.8 \
    --overlaps-at 32768=0.3,0.8 --backends torch-dense-sdpa,triton,jax-triton --time-budget 120 --out "$R/bench"
  alone probe_deterministic 100 python3 scripts/gpu/probe_deterministic.py --out "$R/probe_deterministic"
  alone unions 100 python3 scripts/gpu/probe_unions.py --out "$R/unions" --seq-lens 32768 --overlaps 0.8 \
    --kv-scales 1 32 64 --budget-s 90
  ;;
final)
  # timing only, each step alone: (24,2) across S and overlap, (12,1), the Hopper forward's probe
  side_by_side
  alone forward_sm90 150 python3 scripts/gpu/probe_forward_sm90.py --out "$R/forward_sm90" --budget-s 130
  ;;
sweep)
  # timing only, each step alone: final's two side-by-side benches (no forward probe), then the
  # deterministic backward's probe
  side_by_side
  alone probe_deterministic 100 python3 scripts/gpu/probe_deterministic.py --out "$R/probe_deterministic"
  ;;
lowoverlap)
  # the bottom of the overlap range: random routes (distinct causal IDs, no four-token blocks;
  # adjacent-row Jaccard ~0.13 at S=32768, below what the QSA generator's knob reaches) beside
  # QSA routes at J 0.8 and dense attention, each step alone
  alone bench 300 python3 -m parity.bench --heads 24:2 --seq-lens 8192,32768 --families random --overlaps 0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 270 --out "$R/bench"
  alone bench_12x1 170 python3 -m parity.bench --heads 12:1 --seq-lens 32768 --families random \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 140 --out "$R/bench_12x1"
  ;;
host)
  # torch's host time per step (launch gaps are GPU idle at small S), then S=8192 timing, both
  # head configurations, beside dense; then the tests of the launch path
  alone host 60 python3 scripts/gpu/host_overhead.py --steps 30
  alone bench 130 python3 -m parity.bench --heads 24:2,12:1 --seq-lens 8192 --overlaps 0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 100 --out "$R/bench"
  alone gpu_tests 280 python3 -m pytest -q -p no:cacheprovider tests/test_forward_sm90.py tests/test_triton_qsa.py \
    tests/test_torch_api.py
  ;;
sm90fwd)
  # the Hopper forward against forward.py: the probe alone, the benchmark alone, then the
  # forward's GPU tests beside memcheck
  alone probe 170 python3 scripts/gpu/probe_forward_sm90.py --out "$R/probe" --seq-lens 32768 131072 \
    --overlaps 0.3 0.8 --budget-s 150
  alone bench 110 python3 -m parity.bench --heads 24:2 --seq-lens 8192 --overlaps 0.8 --overlaps-at 32768=0.3,0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 90 --out "$R/bench"
  beside gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_forward_sm90.py tests/test_triton_qsa.py
  beside sanitize_triton 200 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  wait
  ;;
sm90next)
  # the Hopper forward and backward (default and deterministic), each against its tl
  # kernel, then the benchmark; sm90check runs the GPU tests and memcheck
  alone probe_forward 130 python3 scripts/gpu/probe_forward_sm90.py --out "$R/probe_forward" --seq-lens 32768 \
    --overlaps 0.3 0.8 --budget-s 110
  alone probe_backward 250 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe_backward" --budget-s 230 \
    --timeout-s 120
  alone probe_deterministic 100 python3 scripts/gpu/probe_deterministic.py --out "$R/probe_deterministic"
  alone bench 110 python3 -m parity.bench --heads 24:2 --seq-lens 8192 --overlaps 0.8 --overlaps-at 32768=0.3,0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 90 --out "$R/bench"
  ;;
sm90check)
  # the Hopper kernels' GPU checks (after sm90next, on the same machine if warm)
  beside gpu_tests 260 python3 -m pytest -q -x -p no:cacheprovider tests/test_forward_sm90.py \
    tests/test_backward_sm90.py tests/test_triton_qsa.py tests/test_triton_deterministic.py tests/test_jax_triton.py
  beside sanitize_triton 200 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_deterministic 200 python3 scripts/gpu/probe_deterministic.py --out "$R/sanitize_deterministic" \
    --sanitizer
  wait
  ;;
sm90ab)
  # this tree's Hopper backward (default and deterministic) and forward beside another
  # commit's, checked out at .base: each timing step in both trees (the backward's twice);
  # then each tree's deterministic probe. The forward's step needs a .base whose
  # probe_forward_sm90.py has --step (main since the eighth session)
  alone probe_backward 250 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe_backward" --against .base \
    --budget-s 230 --timeout-s 120
  alone probe_backward_again 150 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe_backward_again" \
    --against .base --budget-s 130 --timeout-s 120 --skip-checks
  alone deterministic_base 100 bash -c "cd .base && PYTHONPATH=$root/.base:/tmp/qsa-extra \
    python3 scripts/gpu/probe_deterministic.py --out '$R/deterministic_base'"
  alone deterministic 100 python3 scripts/gpu/probe_deterministic.py --out "$R/deterministic"
  alone probe_forward 170 python3 scripts/gpu/probe_forward_sm90.py --out "$R/probe_forward" --seq-lens 32768 \
    --overlaps 0.3 0.8 --against .base --budget-s 150
  ;;
bwdab)
  # this tree's Hopper backward beside .base's in one call: the probe's checks, then each timing
  # step (S=32768 at J 0.3 and 0.8, S=131072 at J 0.8) in both trees; the step beside dense,
  # alone; the backward's GPU tests and both frameworks' Triton tests side by side
  alone probe_backward 200 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe_backward" --against .base \
    --seq-lens 32768 131072 --overlaps 0.8 --budget-s 180 --timeout-s 120
  alone probe_backward_j03 100 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe_backward_j03" \
    --against .base --seq-lens 32768 --overlaps 0.3 --budget-s 90 --timeout-s 80 --skip-checks
  step_and_tests tests/test_backward_sm90.py
  ;;
fwdab)
  # this tree's Hopper forward beside .base's in one call: the probe's checks, then each timing
  # step (S=32768 at J 0.3 and 0.8, S=131072 at J 0.8) in both trees, J 0.8 twice; the step beside
  # dense, alone; the forward's GPU tests and both frameworks' Triton tests side by side
  alone probe_forward 200 python3 scripts/gpu/probe_forward_sm90.py --out "$R/probe_forward" --against .base \
    --seq-lens 32768 131072 --overlaps 0.8 --budget-s 180 --timeout-s 100
  alone probe_forward_again 150 python3 scripts/gpu/probe_forward_sm90.py --out "$R/probe_forward_again" \
    --against .base --seq-lens 32768 --overlaps 0.8 0.3 --budget-s 140 --timeout-s 80
  step_and_tests tests/test_forward_sm90.py
  ;;
unionab)
  # this tree's route unions beside .base's: torch's and JAX's build_unions at each S and
  # overlap in both trees (digests must agree), with the rank and sort recipes side by side
  # at S=32768 for S_kv up to 64 S; then memcheck of the torch Triton path and both
  # frameworks' Triton tests, side by side
  alone probe_unions 280 python3 scripts/gpu/probe_unions.py --out "$R/probe_unions" --against .base \
    --seq-lens 32768 131072 8192 --overlaps 0.8 0.3 --kv-scales 1 16 32 64 --budget-s 260 --timeout-s 100
  beside sanitize_triton 300 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside gpu_tests 280 python3 -m pytest -q -p no:cacheprovider tests/test_triton_qsa.py tests/test_jax_triton.py
  wait
  ;;
redcap)
  # the backward's adds alone on all SMs and on fewer (a per-SM cap on the adds), then this
  # tree's route unions beside .base's at S=32768 and 131072, then both frameworks' Triton tests
  alone red_rate 150 python3 scripts/gpu/probe_red_rate.py --out "$R/red_rate" --seq-lens 32768 --overlaps 0.8 \
    --sm-fractions 0.5 0.25 0.125 --budget-s 140
  alone probe_unions 200 python3 scripts/gpu/probe_unions.py --out "$R/probe_unions" --against .base \
    --seq-lens 32768 131072 --overlaps 0.8 --kv-scales 1 16 32 --budget-s 180 --timeout-s 100
  alone gpu_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_triton_qsa.py tests/test_jax_triton.py
  ;;
sm90bwd)
  # the Hopper backward (the default non-deterministic backward on sm_90) against backward.py:
  # its probe alone (each step in its own process, time-limited: a hang costs one step),
  # then the benchmark alone, then GPU tests and memcheck side by side
  # (the first step compiles every kernel on a cold cache: 120 s per step)
  alone probe 250 python3 scripts/gpu/probe_backward_sm90.py --out "$R/probe" --budget-s 230 --timeout-s 120
  alone bench 110 python3 -m parity.bench --heads 24:2 --seq-lens 8192 --overlaps 0.8 --overlaps-at 32768=0.3,0.8 \
    --backends torch-dense-sdpa,triton,jax-triton --time-budget 90 --out "$R/bench"
  beside gpu_tests 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_backward_sm90.py tests/test_triton_qsa.py \
    tests/test_jax_triton.py
  beside sanitize_triton 200 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  wait
  ;;
bitwise)
  # torch against JAX where both launch the Hopper kernels: the deterministic GPU tests (the
  # forward output, then each gradient, with the count of differing elements on failure),
  # then check_jax_triton.py (forward and default backward, three layouts, both head configs)
  alone det_tests 240 python3 -m pytest -q -rA -p no:cacheprovider tests/test_triton_deterministic.py -k gpu_fixed_point
  alone jax_triton 200 python3 scripts/gpu/check_jax_triton.py --out "$R/jax_triton" --budget-s 170
  ;;
pallastime)
  # forward+backward at J 0.8 and 0.3 (S=32768) with the forward's third stage and without, then
  # S=8192 and 131072; JAX cuDNN dense in each process
  alone time_j08 200 python3 scripts/gpu/jax_kernel.py --out "$R/time_j08" --time --sizes 32768 --overlap 0.8 \
    --configs triton,pallas,pallas-s3
  alone time_j03 150 python3 scripts/gpu/jax_kernel.py --out "$R/time_j03" --time --sizes 32768 --overlap 0.3 \
    --configs pallas,pallas-s3
  alone time_s 240 python3 scripts/gpu/jax_kernel.py --out "$R/time_s" --time --sizes 8192,131072 --overlap 0.8 \
    --configs triton,pallas
  ;;
pallascheck)
  beside check 300 python3 scripts/gpu/jax_kernel.py --out "$R/check" --check --check-len 8192
  beside parity 420 python3 scripts/gpu/run_parity_and_bench.py --out "$R/parity" --skip-bench --skip-api \
    --budget 360 --parity-args "--backends jax-pallas"
  beside pytest 420 python3 -m pytest -q -p no:cacheprovider tests/test_pallas_qsa.py tests/test_layers.py
  beside sanitize_jax 300 python3 scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation pallas \
    --timeout-s 280
  wait
  ;;
recheck)
  # after fixes to what the three calls above found: the pieces that changed, in one call
  alone bench 130 python3 -m parity.bench --heads 24:2 --seq-lens 131072 --overlaps 0.8 \
    --backends triton,jax-triton --time-budget 85 --out "$R/bench"
  alone probe_deterministic 80 python3 scripts/gpu/probe_deterministic.py --out "$R/probe_deterministic"
  alone nemo 100 python3 scripts/gpu/bench_nemo_layer.py --out "$R/nemo" --seq-lens 32768 \
    --variants qsa_torch flex --time-budget 70
  beside gpu_tests 170 python3 -m pytest -q -p no:cacheprovider tests/test_triton_deterministic.py \
    tests/test_jax_triton.py tests/test_flex_qsa.py tests/test_nemo_automodel_integration.py tests/test_torch_api.py
  beside soak 170 python3 scripts/gpu/soak.py --out "$R/soak" --budget-s 150
  beside sanitize_triton 170 compute-sanitizer --tool memcheck --print-limit 30 \
    python3 scripts/gpu/check_triton.py --sanitizer-probe
  beside sanitize_jax 170 python3 scripts/gpu/sanitize_jax.py --out "$R/sanitize_jax" --implementation triton --timeout-s 160
  beside sanitize_det 170 python3 scripts/gpu/probe_deterministic.py --out "$R/sanitize_det" --sanitizer --sanitizer-timeout 160
  wait
  ;;
esac
stamp done 0
rm -rf "$scratch"
