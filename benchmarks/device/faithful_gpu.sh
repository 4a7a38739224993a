#!/usr/bin/env bash
# The faithful Qwen2.5-0.5B wrapper on the GPU machine, in one background run (README.md here
# stages the weights, the data and the rankings under /tmp/stage first): the wrapper
# self-distilled on full's own answers (no gold labels, three prompt styles in turn, chunks in the
# retriever's order), then the paired evaluations that judge it against full (agreement, contains,
# teacher-forced KL) on SQuAD's test articles, Reddit, the long-form task and Amazon, beside plain
# lazy and the wrapper bundled before it (OLD_WRAPPER).
#   setsid nohup bash benchmarks/device/faithful_gpu.sh > /tmp/stage/logs/driver.log 2>&1 < /dev/null &
# One job on the GPU at a time: beside two other tuning runs and the parity tests the same tuning
# took ~6 s a step instead of ~1 s (the steps are bound by the host's kernel launches), and a chunk
# adapter run beside them ran out of GPU memory. Each eval keeps its checkpoint, and each step
# appends a `done` line to the log, so a poll can copy what exists.
# Other recipes from the same teacher data, e.g. the chunk adapter (LoRA deltas while chunks encode):
#   NAME=qwen05-adapter TUNE_ARGS="--method lora --rank 8 --steps 240" \
#   SETS="squad reddit" bash benchmarks/device/faithful_gpu.sh
set -uo pipefail
S=/tmp/stage
D=$S/data
O=$S/out
L=$S/logs
N=${FAITHFUL_N:-1000}
OLD_WRAPPER=${OLD_WRAPPER:-lazy_rag/wrappers/qwen2.5-0.5b.safetensors}
NAME=${NAME:-qwen05-faithful}
TUNE_ARGS=${TUNE_ARGS:---steps 320}          # after the common recipe below: later flags win
SETS=${SETS:-squad reddit longform amazon}
mkdir -p "$O" "$L" "$S/work"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
Q=$S/qwen.gguf
NEW=$O/$NAME.safetensors

# shellcheck disable=SC2086
python3 benchmarks/device/tune_gpu.py --model $Q --name "$NAME" --data $D/squad_v1.1_dev.json \
  --retrieval $D/retrieval_squad_train_d8.json --prompts mixed --examples 3000 --micro-batch 16 $TUNE_ARGS \
  --work-dir $S/work/q --out $O > "$L/tune-$NAME.log" 2>&1
echo "done tune rc=$?"

evaluate() {  # NAME DATASET DATA RANKING EXTRA...
  local name=${1/qwen05/$NAME} dataset=$2 data=$3 ranking=$4
  shift 4
  python3 benchmarks/device/quality_gpu.py --model $Q --dataset "$dataset" --data "$data" --retrieval "$ranking" \
    --k 4 --n "$N" --batch-size 64 --configs "full,lazy,lazy+wrapper:$OLD_WRAPPER,lazy+wrapper:$NEW" \
    --name "$name" --out $O "$@" > $L/eval-$name.log 2>&1
  echo "done eval $name rc=$?"
}

for set in $SETS; do
  case $set in
    squad) evaluate qwen05_squad squad $D/squad_v1.1_dev.json $D/retrieval_squad_test_d8.json ;;
    reddit) evaluate qwen05_reddit reddit $D/reddit_v1.0.json $D/retrieval_reddit_test_d8.json ;;
    longform) evaluate qwen05_longform squad $D/squad_v1.1_dev.json $D/retrieval_squad_test_d8.json --n 300 --prompts longform ;;
    amazon) evaluate qwen05_amazon amazon_reviews $D/amazon_reviews_v1.0.json $D/retrieval_amazon_reviews_test_d8.json ;;
    *) echo "unknown set $set (squad, reddit, longform, amazon)"; exit 2 ;;
  esac
done
echo "done all"
