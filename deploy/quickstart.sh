#!/usr/bin/env bash
# The newcomer's first command: install, build, and run the main job: ddpworker, the built-in
# trainer, learning Fashion-MNIST (Debian's dataset-fashion-mnist) on 2 workers under ddprun,
# printing progress and the final test accuracy (about 91%, a few minutes on 2 cores).
#   deploy/quickstart.sh [section.key=value ...]    e.g. train.epochs=1
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
echo "== ddprun --standalone --nproc-per-node 2 docs/examples/fashion-mnist.conf $*"
exec build/launcher/ddprun --standalone --nproc-per-node 2 docs/examples/fashion-mnist.conf "$@"
