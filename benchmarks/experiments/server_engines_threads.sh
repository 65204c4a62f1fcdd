#!/usr/bin/env bash
# Eight engines on one server (GPU host): each server thread's CPU share, sampled over 2 s four times once all
# eight are running, and py-spy's samples of every server thread (idle ones too) for 8 s. Needs py-spy on PATH.
#   benchmarks/experiments/server_engines_threads.sh OUT [ROUNDS]
# Then e.g. `grep kvferry-server OUT/server.txt` for the socket thread's stacks (py-spy's raw format).
set -u
out=$1
rounds=${2:-5000}
mkdir -p "$out"
python3 -m kvferry.cli bench server-engines --engines 8 --device cuda --rounds "$rounds" --think-ms 2 --ipc \
    --json "$out/engines.json" > "$out/bench.log" 2>&1 &
bench=$!
server=""
for _ in $(seq 120); do
    server=$(pgrep -f "kvferry.server" | head -1)
    [ -n "$server" ] && break
    sleep 0.5
done
for _ in $(seq 240); do  # the engines all run once the bench has eight children besides the server
    [ "$(pgrep -P $bench | wc -l)" -ge 9 ] && break
    sleep 0.5
done
sleep 12  # past the engines' start-up
python3 - "$server" > "$out/threads.txt" <<'PY' &
import os, sys, time
pid = sys.argv[1]
def snap():
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])
    return out
for _ in range(4):
    before = snap()
    time.sleep(2)
    after = snap()
    shares = sorted(((after[t] - before[t]) / 2, t) for t in after if t in before)[::-1][:8]
    print("CPU % per thread over 2 s (top 8; tid):", [(round(share), tid) for share, tid in shares], flush=True)
PY
sampler=$!
py-spy record -p "$server" -d 8 -r 250 --threads --idle -f raw -o "$out/server.txt" > "$out/py-spy.log" 2>&1
wait $sampler
wait $bench
tail -8 "$out/bench.log"
cat "$out/threads.txt"
