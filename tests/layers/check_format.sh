#!/usr/bin/env bash
# Checks that every tracked C, C++, CUDA and header file is formatted as the
# repository's .clang-format says (clang-format --dry-run -Werror).
#
#   check_format.sh SOURCE_ROOT      exit 0 clean, 1 listing the files that
#                                    are not, 77 without clang-format or git
#
# To fix: clang-format -i FILE (or every file: see the README's Style notes).
set -uo pipefail
src=${1:?usage: check_format.sh SOURCE_ROOT}
cd "$src" || exit 2
command -v clang-format > /dev/null || { echo "SKIP: clang-format is not installed"; exit 77; }
command -v git > /dev/null && git rev-parse --git-dir > /dev/null 2>&1 ||
  { echo "SKIP: not a git checkout"; exit 77; }
bad=0
while IFS= read -r f; do
  if ! clang-format --dry-run -Werror "$f" > /dev/null 2>&1; then
    echo "not formatted: $f"
    bad=$((bad + 1))
  fi
done < <(git ls-files '*.c' '*.h' '*.cu' '*.cuh' '*.cc')
echo "$bad file(s) not formatted ($(clang-format --version | head -n 1))"
[ $bad -eq 0 ]
