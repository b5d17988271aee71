#!/usr/bin/env bash
# Build the libFuzzer harnesses with clang and run them for a bounded time (default 60 s in all)
# over a copy of their seed corpora; exits non-zero on any crash, leak or invariant violation.
#   tests/fuzz/run_fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
build=build-fuzz
CC=clang cmake -S . -B "$build" -DDDP_BUILD_FUZZ=ON -DDDP_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" --target fuzz_store_proto fuzz_file_parsers -j "$(nproc)" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Each harness gets half the time, over a copy of its seed corpus.
for fuzzer in fuzz_store_proto fuzz_file_parsers; do
    mkdir -p "$work/$fuzzer"
    cp tests/fuzz/corpus/"$fuzzer"/* "$work/$fuzzer/"
    echo "-- $fuzzer"
    "$build/tests/fuzz/$fuzzer" -max_total_time="$(( (seconds + 1) / 2 ))" -max_len=4096 \
        -print_final_stats=1 -artifact_prefix="$build/" "$work/$fuzzer" 2>&1 | tail -n 6
done
