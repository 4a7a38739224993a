#!/usr/bin/env bash
# Index a folder, query it, inspect it: the lazy-rag command line, offline on the CPU.
#   bash examples/cli_walkthrough.sh
set -euo pipefail
export HF_HUB_OFFLINE=1
cd "$(dirname "$0")"
MAX_NEW_TOKENS="${LAZY_RAG_MAX_NEW_TOKENS:-48}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

echo "== lazy-rag index: chunk, embed, and precompute every chunk's KV once"
lazy-rag index corpus --out "$WORK/index" --chunk-size 128

echo "== lazy-rag inspect: chunks, tokens, KV bytes, model fingerprint (no model loaded)"
lazy-rag inspect "$WORK/index"

echo "== lazy-rag query: streams the answer, then sources and how much came from cache"
lazy-rag query "$WORK/index" "When does the bakery open?" --top-k 2 --max-new-tokens "$MAX_NEW_TOKENS"

echo "== lazy-rag query --json: the same, as one JSON object"
lazy-rag query "$WORK/index" "Who is the head baker?" --top-k 2 --max-new-tokens "$MAX_NEW_TOKENS" --json \
  | python3 -c 'import json, sys; r = json.load(sys.stdin); s = r["stats"]
print("answer:", r["answer"].strip())
print("sources:", ", ".join(x["chunk_id"] for x in r["sources"]))
print("prompt {prompt_tokens} tokens: {cached_tokens} from cache, {computed_tokens} computed".format(**s))'
