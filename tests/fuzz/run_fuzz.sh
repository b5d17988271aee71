#!/usr/bin/env bash
# Build the libFuzzer harnesses with clang and run each for a bounded time (default 60 s) over a
# copy of the seed corpus; exits non-zero on any crash, leak or invariant violation.
#   tests/fuzz/run_fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../.."
seconds="${1:-60}"
build=build-fuzz
CC=clang cmake -S . -B "$build" -DDDP_BUILD_FUZZ=ON -DDDP_BUILD_TESTS=OFF >/dev/null
cmake --build "$build" --target fuzz_store_proto -j "$(nproc)" >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp tests/fuzz/corpus/* "$work/"
"$build/tests/fuzz/fuzz_store_proto" -max_total_time="$seconds" -max_len=4096 \
    -print_final_stats=1 -artifact_prefix="$build/" "$work" 2>&1 | tail -n 12
