#!/usr/bin/env bash
# Question: none of its own; it sets up the in-process A/Bs (ab_cache_store.py, ab_transfer_tree.py), which answer
# theirs: a renamed copy of kvferry as of a commit, importable beside the working tree (the GPU host's speed drifts
# between runs more than most changes move a number, so the two trees are timed by turns in one process):
#   benchmarks/experiments/baseline_tree.sh REV      ->  src/kvferry_base (untracked: delete it when done)
# Imports are renamed, and so are Prometheus metric names (both trees register metrics in one process).
set -euo pipefail
rev=${1:?usage: benchmarks/experiments/baseline_tree.sh REV}
cd "$(dirname "$0")/../.."
rm -rf src/kvferry_base
tmp=$(mktemp -d)
git archive "$rev" src/kvferry | tar -x -C "$tmp"
mv "$tmp/src/kvferry" src/kvferry_base
rm -rf "$tmp"
# Metric names first: renaming them after the modules would turn "kvferry_base.server" into "kvferrybase_base...".
find src/kvferry_base -name '*.py' -exec sed -i -e 's/"kvferry_/"kvferrybase_/g' -e 's/\bkvferry\./kvferry_base./g' \
    -e 's/\bfrom kvferry import/from kvferry_base import/g' -e 's/^import kvferry$/import kvferry_base/' {} +
echo "src/kvferry_base: kvferry as of $(git rev-parse --short "$rev")"
