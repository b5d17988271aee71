#!/usr/bin/env bash
# The C, C++ and CUDA sources as .clang-format writes them: clang-format --dry-run -Werror over
# every tracked .c, .h, .cu, .cuh and .cpp file (git ls-files: build folders and dependencies are
# not the tree's). Exits 1 with clang-format's diagnostics for the lines that differ, 2 when
# clang-format is missing.
#   tests/tools/check_format.sh          check
#   tests/tools/check_format.sh --fix    rewrite the files in place (clang-format -i)
# tests/run.sh runs the check once the tree has been formatted (its check_format switch).
set -euo pipefail
cd "$(dirname "$0")/../.."
clang_format="${CLANG_FORMAT:-clang-format}"
if ! command -v "$clang_format" >/dev/null; then
    echo "check_format.sh: $clang_format not found (Debian: apt-get install clang-format)" >&2
    exit 2
fi
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files -- '*.c' '*.h' '*.cu' '*.cuh' '*.cpp')
else # a source tree without .git (an unpacked sdist or archive): the same files, found
    mapfile -t files < <(find . \( -path './build*' -o -path './.deps' -o -path './.git' \) -prune -o \
        -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' \) \
        -print | sed 's|^\./||' | sort)
fi
if [ "${1:-}" = "--fix" ]; then
    "$clang_format" -i --style=file "${files[@]}"
    echo "check_format.sh: formatted ${#files[@]} files"
    exit 0
fi
if ! "$clang_format" --dry-run -Werror --style=file "${files[@]}"; then
    echo "check_format.sh: the files above are not as .clang-format writes them:" \
         "tests/tools/check_format.sh --fix rewrites them" >&2
    exit 1
fi
echo "check_format.sh: ${#files[@]} files formatted"
