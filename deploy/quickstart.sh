#!/usr/bin/env bash
# The newcomer's first command: install, build, and run the main job.
# Until the trainer lands, the main job shows the two parts that exist: the store (`ddprun store`,
# our client and PyTorch's own TCPStore client) and the launcher running a PyTorch DDP script
# (gloo, CPU) on 2 workers, as torchrun would.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/setup.sh
ddprun=build/launcher/ddprun
work=$(mktemp -d)
trap 'kill "$store_pid" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$ddprun" store --host 127.0.0.1 --port 0 --port-file "$work/port" &
store_pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.05; done
port=$(cat "$work/port")
cli() { "$ddprun" store-client --endpoint "127.0.0.1:$port" "$@"; }

echo "== store on 127.0.0.1:$port"
cli set greeting "hello from ddprun"
echo "get greeting        -> $(cli get greeting)"
echo "add counter 5       -> $(cli add counter 5)"
echo "add counter 37      -> $(cli add counter 37)"
echo "compare-set ...     -> $(cli compare-set greeting 'hello from ddprun' updated)"
( sleep 0.3; cli set round/1/ready yes ) &
echo "wait round/1/ready  -> woke after another client set it"
cli wait round/1/ready
echo "num-keys            -> $(cli num-keys)"
echo "ping                -> $(cli ping)"
if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
    # PyTorch's own client on our store; it prefixes its keys with "/".
    /usr/bin/python3 - "$port" <<'PY'
import sys, datetime
from torch.distributed import TCPStore
s = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=10))
s.set("from_torch", "hello from PyTorch's TCPStore client")
print("torch add(counter)  ->", s.add("counter", 1), "(its key is /counter)")
PY
    echo "get /from_torch     -> $(cli get /from_torch)"
fi
kill -TERM "$store_pid"
wait "$store_pid"
echo "== store stopped cleanly"

if /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
    echo "== ddprun --standalone --nproc-per-node 2 tests/interop/scripts/ddp_linear.py"
    PYTHON_EXEC=/usr/bin/python3 "$ddprun" --standalone --nproc-per-node 2 \
        tests/interop/scripts/ddp_linear.py
else
    echo "== ddprun --standalone --nproc-per-node 2 (Debian's python3-torch is not installed: a shell worker)"
    "$ddprun" --standalone --nproc-per-node 2 --no-python sh -c 'echo "rank $RANK of $WORLD_SIZE"'
fi
