#!/usr/bin/env bash
# Everything that needs a GPU, in one call of a GPU machine (a fresh Ubuntu with CUDA, cuDNN, NCCL
# and PyTorch; the rest carried by deploy/gpu_deps.sh --with-data as .deps/root):
#   tests/gpu/run.sh [build] [unit] [smoke] [e2e] [bench] [profile] [bench-compile] [startup]
#   (default: build unit smoke e2e bench startup; stages run in this order)
# Knobs: BENCH_ARGS, BENCH_COMPILE_ARGS (bench_gpu_train.py arguments; default: the GPU issue's
# rows in bf16 and fp16, RESULT lines), PROFILE_PRECISIONS
# ("fp32 bf16"), PROFILE_TOP (lines shown), STARTUP_REPEATS. The carried folder: run it with
# carry [".deps/root"]. Logs and JSON results go to $OUT (else gpu-out/); a summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(build unit smoke e2e bench startup)
has() { local s; for s in "${stages[@]}"; do [ "$s" = "$1" ] && return 0; done; return 1; }
summary=()
note() { summary+=("$*"); echo "== $*"; }

source deploy/gpu_deps.sh --env
export DDP_DATA_DIR="$PWD/.deps/root/usr/share/datasets/fashion-mnist"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
note "gpu: $(cat "$out/gpu.txt")"

if has build; then
    t0=$SECONDS
    if cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >"$out/build.log" 2>&1 &&
       cmake --build build -j"$(nproc)" >>"$out/build.log" 2>&1; then
        note "build: ok in $((SECONDS - t0)) s ($(grep -E 'CUDA|cuDNN|NCCL' "$out/build.log" | tr -s ' ' | tr '\n' ';'))"
    else
        tail -40 "$out/build.log"
        note "build: FAILED (build.log)"
        printf '%s\n' "${summary[@]}"
        exit 1
    fi
fi

if has unit; then
    (cd build && ctest -R 'backend_cuda|comm_nccl' --output-on-failure -V) >"$out/unit.log" 2>&1
    note "unit: rc $? — $(grep -E 'tests passed|Synthesis' "$out/unit.log" | tr '\n' ' ')"
    grep -E 'FAIL|relative error|Assertion|max \|' "$out/unit.log" | head -20
fi

if has smoke; then
    build/worker/ddpworker docs/examples/fashion-mnist.conf train.backend=cuda train.epochs=1 \
        data.dir="$DDP_DATA_DIR" train.log_interval=200 >"$out/smoke.log" 2>&1
    note "smoke (cnn, Fashion-MNIST, 1 epoch, cuda): rc $? — $(grep -E 'final|img/s' "$out/smoke.log" | tail -2 | tr '\n' ' ')"
    tail -3 "$out/smoke.log"
fi

if has e2e; then
    DDP_BUILD_DIR=build python3 -m pytest -q -rA --durations=0 tests/e2e/test_gpu.py \
        tests/interop/test_torch_loss_scale.py >"$out/e2e.log" 2>&1
    note "e2e: rc $? — $(tail -1 "$out/e2e.log")"
    grep -E '^(FAILED|ERROR)|Error|error:' "$out/e2e.log" | head -20
fi

if has bench; then
    PYTHONUNBUFFERED=1 DDP_BUILD_DIR=build python3 tests/bench/bench_gpu_train.py \
        ${BENCH_ARGS:---rows resnet18-cifar,resnet50-128 --precisions bf16,fp16} \
        --json "$out/bench_gpu_train.json" >"$out/bench.log" 2>&1
    note "bench: rc $?"
    tail -12 "$out/bench.log"
fi

if has profile; then
    for prec in ${PROFILE_PRECISIONS:-fp32}; do
        DDP_BUILD_DIR=build python3 tests/gpu/profile.py --precision "$prec" --out "$out" >"$out/profile_$prec.log" 2>&1
        note "profile $prec: rc $? — $(head -1 "$out/profile_$prec.log")"
        head -${PROFILE_TOP:-16} "$out/profile_$prec.log" | tail -n +2
    done
fi

if has bench-compile; then
    PYTHONUNBUFFERED=1 DDP_BUILD_DIR=build python3 tests/bench/bench_gpu_train.py --compile \
        ${BENCH_COMPILE_ARGS:---rows resnet18-cifar --precisions bf16,fp16} --json "$out/bench_compile.json" >"$out/bench_compile.log" 2>&1
    note "bench-compile: rc $?"
    tail -6 "$out/bench_compile.log"
fi

if has startup; then
    PYTHONUNBUFFERED=1 DDP_BUILD_DIR=build python3 tests/bench/bench_gpu_startup.py \
        --repeats ${STARTUP_REPEATS:-3} --json "$out/bench_startup.json" >"$out/startup.log" 2>&1
    note "startup: rc $?"
    tail -8 "$out/startup.log"
fi

echo
printf '%s\n' "${summary[@]}"
