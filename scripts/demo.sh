#!/usr/bin/env bash
# What `make demo` runs until the end-to-end demo lands (issue 6): the pieces that exist today,
# on an embedded default deployment of one prefill and one decode instance, TP 2 each, on this
# host. No KV bytes move yet; this shows the rank table a deployment uses and the exact reads,
# TP mapping and reader counts the connector will perform.
set -euo pipefail
kvferry=${1:-build/kvferry}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== kvferry demo (foundation): the transfer demo arrives with the end-to-end work =="
echo
echo "-- 1. a rank table for 1 prefill + 1 decode instance, TP 2 each, on 127.0.0.1"
"$kvferry" ranktable gen --hosts 127.0.0.1 --devices-per-host 4 --prefill 2 --decode 2 \
  -o "$work/ranktable.json"
"$kvferry" ranktable check "$work/ranktable.json"
echo
echo "-- 2. the entry decode TP rank 1 selects"
"$kvferry" ranktable check "$work/ranktable.json" --role kv_consumer --server-id 127.0.0.1 --tp-rank 1
echo
echo "-- 3. the reads for a Llama-3-8B-shaped cache (32 layers, 8 KV heads, bf16), TP 2 -> 2,"
echo "      a 9-block prompt of which the decode side already holds 2 (prefix hit)"
"$kvferry" plan --kind mha --layers 32 --kv-heads 8 --head-dim 128 --prefill-tp 2 --decode-tp 2 \
  --remote-blocks 40,41,42,43,44,45,46,47,48 --local-blocks 7,8,9,10,20,21,22
echo
echo "-- 4. the same for a DeepSeek-shaped MLA cache (61 layers), prefill TP 2 -> decode TP 4"
"$kvferry" plan --kind mla --layers 61 --latent-dim 512 --rope-dim 64 --tokens-per-block 128 \
  --prefill-tp 2 --decode-tp 4 --remote-blocks 3,4,5,6 --local-blocks 10,11,12,13
echo
echo "demo: ok"
