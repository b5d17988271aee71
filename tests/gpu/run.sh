#!/usr/bin/env bash
# Everything that needs a GPU, in one call of a GPU machine (a fresh Ubuntu with CUDA, cuDNN, NCCL
# and PyTorch; the rest carried by deploy/gpu_deps.sh --with-data as .deps/root):
#   tests/gpu/run.sh [build] [unit] [smoke] [e2e] [bench] [profile] [bench-compile] [startup]
#                    [memsnap]
#   (default: build unit smoke e2e bench startup; stages run in this order)
# Knobs: BENCH_ARGS, BENCH_COMPILE_ARGS (bench_gpu_train.py arguments; default: its standard
# workloads, --rows, in bf16 and fp16, RESULT lines), PROFILE_PRECISIONS
# ("fp32 bf16"), PROFILE_TOP (lines shown), STARTUP_REPEATS, MEMSNAP_ARGS (bench_memory_snapshot.py
# arguments; default ResNet-18 and ResNet-50 in bf16, 2 on/off rounds). The carried folder: run it with
# carry [".deps/root"]. Logs and JSON results go to $OUT (else gpu-out/); a summary is printed last.
# Exit status: 0 only when every stage that ran passed; a failed stage does not stop the later ones
# (except build, which they all need), and the summary says which failed.
# GPU_BUILD_DIR: the build folder (default build/).
# DDP_GPU_DRY_RUN=1 runs the script's own logic on a machine without a GPU: no nvidia-smi, no
# gpu_deps.sh; a stage named fail-NAME is a stage that fails (to check the exit status).
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build unit smoke e2e bench startup)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
summary=()
failed=()
note() { summary+=("$*"); echo "== $*"; }
# stage_rc NAME RC: records a failed stage (RC != 0); returns RC
stage_rc() {
    [ "$2" -eq 0 ] || failed+=("$1 (rc $2)")
    return "$2"
}
finish() {
    echo
    printf '%s\n' "${summary[@]}"
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED stages: ${failed[*]}"
        exit 1
    fi
    echo "all stages passed: ${stages[*]}"
    exit 0
}
for s in "${stages[@]}"; do
    case "$s" in
        build | unit | smoke | e2e | bench | profile | bench-compile | startup | memsnap | fail-*) ;;
        *) echo "tests/gpu/run.sh: unknown stage '$s'" >&2; exit 2 ;;
    esac
done
# The build every stage (and conftest.py, through DDP_BUILD_DIR) uses: the one the build stage
# makes (GPU_BUILD_DIR, default build/).
build="$(realpath -m "${GPU_BUILD_DIR:-build}")"
export DDP_BUILD_DIR="$build"
dry="${DDP_GPU_DRY_RUN:-0}"

if [ "$dry" = 1 ]; then
    note "gpu: none (DDP_GPU_DRY_RUN=1)"
else
    source deploy/gpu_deps.sh --env
    export DDP_REQUIRE_GPU=1  # test_gpu.py fails instead of skipping when it finds no GPU
    export DDP_DATA_DIR="$PWD/.deps/root/usr/share/datasets/fashion-mnist"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
    stage_rc gpu $? || true
    note "gpu: $(cat "$out/gpu.txt")"
fi

for s in "${stages[@]}"; do
    case "$s" in
        fail-*) note "$s: rc 3 (a stage that fails, for DDP_GPU_DRY_RUN)"; stage_rc "$s" 3 ;;
    esac
done

if has build; then
    t0=$SECONDS
    if cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >"$out/build.log" 2>&1 &&
       cmake --build "$build" -j"$(nproc)" >>"$out/build.log" 2>&1; then
        note "build: ok in $((SECONDS - t0)) s ($(grep -E 'CUDA|cuDNN|NCCL' "$out/build.log" | tr -s ' ' | tr '\n' ';'))"
    else
        tail -40 "$out/build.log"
        note "build: FAILED (build.log)"
        stage_rc build 1
        finish
    fi
fi

if has unit; then
    # the CUDA unit tests (tests/gpu/CMakeLists.txt: test_backend_cuda; tests/unit/CMakeLists.txt:
    # test_cuda_fused with the fused kernels' host emulation; NCCL has none of its own); any test
    # that skipped (no GPU visible) counts as a failure here
    cuda_tests='^(test_backend_cuda|test_cuda_fused|test_cuda_bn_act_emulated)$'
    (cd "$build" && CRITERION_VERBOSITY_LEVEL=1 ctest -R "$cuda_tests" --no-tests=error \
        --output-on-failure -V) >"$out/unit.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && grep -qE '\[SKIP\]|Synthesis: Tested: 0 ' "$out/unit.log"; then
        echo "unit: CUDA tests skipped (no GPU visible?)" >>"$out/unit.log"
        rc=4
    fi
    stage_rc unit $rc
    note "unit: rc $rc — $(grep -E 'tests passed|Synthesis' "$out/unit.log" | tr '\n' ' ')"
    grep -E 'FAIL|relative error|Assertion|skipped|outside rtol' "$out/unit.log" | grep -v ' 0 of ' | head -20
fi

if has smoke; then
    "$build"/worker/ddpworker docs/examples/fashion-mnist.conf train.backend=cuda train.epochs=1 \
        data.dir="$DDP_DATA_DIR" train.log_interval=200 >"$out/smoke.log" 2>&1
    rc=$?
    stage_rc smoke $rc
    note "smoke (cnn, Fashion-MNIST, 1 epoch, cuda): rc $rc — $(grep -E 'final|img/s' "$out/smoke.log" | tail -2 | tr '\n' ' ')"
    tail -3 "$out/smoke.log"
fi

if has e2e; then
    python3 -m pytest -q -rA --durations=0 tests/gpu/test_gpu.py \
        tests/interop/test_torch_loss_scale.py >"$out/e2e.log" 2>&1
    rc=$?
    if [ $rc -eq 0 ] && ! tail -1 "$out/e2e.log" | grep -qE '[0-9]+ passed'; then
        echo "e2e: nothing passed (every test skipped)" >>"$out/e2e.log"
        rc=5
    fi
    stage_rc e2e $rc
    note "e2e: rc $rc — $(tail -1 "$out/e2e.log")"
    grep -E '^(FAILED|ERROR)|Error|error:' "$out/e2e.log" | head -20
fi

if has bench; then
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu_train.py \
        ${BENCH_ARGS:---rows resnet18-cifar,resnet50-128 --precisions bf16,fp16} \
        --json "$out/bench_gpu_train.json" >"$out/bench.log" 2>&1
    rc=$?
    stage_rc bench $rc
    note "bench: rc $rc"
    tail -12 "$out/bench.log"
fi

if has profile; then
    for prec in ${PROFILE_PRECISIONS:-fp32}; do
        python3 tests/gpu/profile.py --precision "$prec" --out "$out" >"$out/profile_$prec.log" 2>&1
        rc=$?
        stage_rc "profile $prec" $rc
        note "profile $prec: rc $rc — $(head -1 "$out/profile_$prec.log")"
        head -${PROFILE_TOP:-16} "$out/profile_$prec.log" | tail -n +2
    done
fi

if has bench-compile; then
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu_train.py --compile \
        ${BENCH_COMPILE_ARGS:---rows resnet18-cifar --precisions bf16,fp16} --json "$out/bench_compile.json" >"$out/bench_compile.log" 2>&1
    rc=$?
    stage_rc bench-compile $rc
    note "bench-compile: rc $rc"
    tail -6 "$out/bench_compile.log"
fi

if has memsnap; then
    # memory snapshots every step on the GPU (side-stream copy) against none, and kill -9 to the
    # resumed step from memory against the disk path (docs/reliability.md)
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_memory_snapshot.py --backend cuda --ranks 1 \
        ${MEMSNAP_ARGS:---precision bf16 --rounds 2} --json "$out/bench_memsnap.json" \
        >"$out/memsnap.log" 2>&1
    rc=$?
    stage_rc memsnap $rc
    note "memsnap: rc $rc"
    tail -10 "$out/memsnap.log"
fi

if has startup; then
    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu_startup.py \
        --repeats ${STARTUP_REPEATS:-3} --json "$out/bench_startup.json" >"$out/startup.log" 2>&1
    rc=$?
    stage_rc startup $rc
    note "startup: rc $rc"
    tail -8 "$out/startup.log"
fi

finish
