#!/usr/bin/env bash
# Serve a model with vLLM's OpenAI-compatible server, its KV cache shared through one kvferry server.
# Every vLLM process started like the one below (on this host) reuses the prompt prefixes any of them computed.
# Server mode works with vLLM's default process layout; embedded mode ("mode": "embedded") keeps the cache in
# the engine and, on vLLM's CPU backend, needs VLLM_ENABLE_V1_MULTIPROCESSING=0.
#
#   pip install -e '.[vllm]'
#   bash examples/vllm_serve_with_kvferry_server.sh Qwen/Qwen2.5-0.5B-Instruct
set -euo pipefail
MODEL=${1:?usage: $0 MODEL}

# The kvferry server: 8 GiB of host memory for chunk objects, then a local disk tier. It listens on
# 127.0.0.1:5555 (HTTP /health /metrics /stats on 5556); `kvferry server --help` lists every setting.
kvferry server --l1-size-gb 8 --l2 "disk:/var/tmp/kvferry?size=50GB" &
KVFERRY_PID=$!
trap 'kill $KVFERRY_PID' EXIT

vllm serve "$MODEL" --kv-transfer-config '{
  "kv_connector": "KvferryConnector",
  "kv_connector_module_path": "kvferry.integrations.vllm",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {"mode": "server", "server_url": "tcp://127.0.0.1:5555"}
}'
