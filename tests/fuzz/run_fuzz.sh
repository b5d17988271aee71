#!/usr/bin/env bash
# Build the libFuzzer harnesses with clang (ASan + UBSan, in build-fuzz/) and run them for a
# bounded time over a copy of their seed corpora (tests/fuzz/corpus/<harness>/, left unchanged).
# Exits non-zero on any crash, leak, timeout, OOM, sanitizer report or invariant violation; the
# input that caused it is kept as build-fuzz/<harness>-crash-* (or -leak-, -timeout-, -oom-) and
# replays with: build-fuzz/tests/fuzz/<harness> FILE
#   tests/fuzz/run_fuzz.sh [SECONDS] [HARNESS...]
# SECONDS (default 60) is the total, shared equally by the harnesses (default: all of them).
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
[ $# -gt 0 ] && shift
harnesses=("$@")
[ ${#harnesses[@]} -gt 0 ] || harnesses=(fuzz_store_proto fuzz_file_parsers fuzz_rdzv_record fuzz_safetensors
                                         fuzz_image_decode fuzz_slurm_hostlist fuzz_etcd_answer
                                         fuzz_spare_handoff)
build="${DDP_FUZZ_BUILD_DIR:-build-fuzz}"
case "$seconds" in '' | *[!0-9]*) echo "run_fuzz.sh: SECONDS must be a whole number" >&2; exit 2 ;; esac

mkdir -p "$build"
if ! CC=clang cmake -S . -B "$build" -DDDP_BUILD_FUZZ=ON -DDDP_BUILD_TESTS=OFF \
        -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$build/configure.log" 2>&1; then
    cat "$build/configure.log" >&2
    exit 1
fi
if ! grep -q '^CMAKE_C_COMPILER:.*clang' "$build/CMakeCache.txt"; then
    echo "run_fuzz.sh: $build was configured with another compiler; remove it and rerun" >&2
    exit 1
fi
if ! cmake --build "$build" --target "${harnesses[@]}" -j "$(nproc)" >"$build/build.log" 2>&1; then
    tail -n 40 "$build/build.log" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
per=$(( seconds / ${#harnesses[@]} ))
[ "$per" -ge 1 ] || per=1
# UBSan only reports by default; make every report a crash the fuzzer stops on.
export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
failed=0
for fuzzer in "${harnesses[@]}"; do
    mkdir -p "$work/$fuzzer"
    cp tests/fuzz/corpus/"$fuzzer"/* "$work/$fuzzer/"
    log="$build/$fuzzer.log"
    rc=0
    "$build/tests/fuzz/$fuzzer" -max_total_time="$per" -max_len=4096 -timeout=10 \
        -rss_limit_mb=2048 -use_value_profile=1 -print_final_stats=1 \
        -artifact_prefix="$build/$fuzzer-" "$work/$fuzzer" >"$log" 2>&1 || rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    rss=$(sed -n 's/^stat::peak_rss_mb: *//p' "$log")
    cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+/[0-9]+[a-zA-Z]*' "$log" | tail -n 1 || true)
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "-- $fuzzer: FAILED (exit $rc) after ${execs:-?} runs; log $log" >&2
        grep -E 'ERROR|SUMMARY|runtime error|Test unit written|deadly signal' "$log" | head -n 20 >&2 || true
        tail -n 30 "$log" >&2
    else
        echo "-- $fuzzer: ok, ${per}s, ${execs:-?} runs, $cov, peak RSS ${rss:-?} MB, no crash"
    fi
done
exit "$failed"
