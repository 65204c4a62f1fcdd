cat /sys/fs/cgroup/memory.max 2>/dev/null; free -g | head -2
(while true; do free -m | awk 'NR==2{print $3}'; sleep 0.5; done) > /tmp/mem.log &
sampler=$!
export TRITON_CACHE_DIR=/tmp/tc-mem; rm -rf $TRITON_CACHE_DIR
timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/transfer/test_gpu.py -k "realistic and NP_X_NB_BS_ONE_HS" 2>&1 | tail -2
kill $sampler
echo "used MiB: start $(head -1 /tmp/mem.log) max $(sort -n /tmp/mem.log | tail -1)"
