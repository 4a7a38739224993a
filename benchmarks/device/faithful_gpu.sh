#!/usr/bin/env bash
# Faithful wrappers on the GPU machine, in one background run (benchmarks/device/README.md stages
# the weights, the data and the rankings under /tmp/stage first): Qwen2.5-0.5B and SmolLM2
# wrappers self-distilled on full's own answers (no gold labels, three prompt styles, chunks in
# the retriever's order), then the paired evaluations that judge them against full (agreement,
# contains, teacher-forced KL) on SQuAD's test articles, Reddit and Amazon, and the long-form task.
#   setsid nohup bash benchmarks/device/faithful_gpu.sh > /tmp/stage/logs/driver.log 2>&1 < /dev/null &
# Each step writes under /tmp/stage/out and a `done STEP` line to the driver's log, so a poll can
# copy what exists; the evals keep their checkpoints, so a lost machine resumes them after restaging.
set -uo pipefail
S=/tmp/stage
D=$S/data
O=$S/out
L=$S/logs
W=$S/work
N=${FAITHFUL_N:-1000}
mkdir -p "$O" "$L" "$W"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

tune() {  # NAME MODEL WORK EXTRA...
  local name=$1 model=$2 work=$3
  shift 3
  python3 benchmarks/device/tune_gpu.py --model "$model" --name "$name" --data $D/squad_v1.1_dev.json \
    --retrieval $D/retrieval_squad_train_d8.json --prompts mixed --work-dir "$work" --out $O "$@" \
    > $L/tune-$name.log 2>&1
  echo "done tune $name rc=$?"
}

evaluate() {  # NAME MODEL DATASET DATA RETRIEVAL CONFIGS EXTRA...
  local name=$1 model=$2 dataset=$3 data=$4 retrieval=$5 configs=$6
  shift 6
  python3 benchmarks/device/quality_gpu.py --model "$model" --dataset "$dataset" --data "$data" \
    --retrieval "$retrieval" --n "$N" --k 4 --configs "$configs" --name "$name" --out $O "$@" \
    > $L/eval-$name.log 2>&1
  echo "done eval $name rc=$?"
}

Q=$S/qwen.gguf
SM=$S/smollm2.gguf
QV=$O/qwen05-faithful.safetensors
QL=$O/qwen05-faithful-lora.safetensors
SV=$O/smollm2-faithful.safetensors

# the two Qwen recipes share one teacher (3,000 prompts): the vector-only one computes it, the
# chunk-adapter one starts once it is cached; SmolLM2's run is small enough to share the GPU
tune qwen05-faithful $Q $W/q --examples 3000 --micro-batch 16 --steps 320 &
tune smollm2-faithful $SM $W/s --examples 2000 --micro-batch 16 --steps 240 &
until ls $W/q/teacher-*.pt >/dev/null 2>&1 || ! jobs %1 >/dev/null 2>&1; do sleep 5; done
tune qwen05-faithful-lora $Q $W/q --examples 3000 --micro-batch 16 --steps 240 --method lora &
wait
echo "done tuning"

B=lazy_rag/wrappers
evaluate smollm2_squad $SM squad $D/squad_v1.1_dev.json $D/retrieval_squad_test_d8.json \
  "full,lazy,lazy+wrapper:$B/smollm2.safetensors,lazy+wrapper:$SV"
evaluate qwen05_squad $Q squad $D/squad_v1.1_dev.json $D/retrieval_squad_test_d8.json \
  "full,lazy,lazy+wrapper:$B/qwen2.5-0.5b.safetensors,lazy+wrapper:$QV,lazy+wrapper:$QL"
evaluate qwen05_reddit $Q reddit $D/reddit_v1.0.json $D/retrieval_reddit_test_d8.json \
  "full,lazy,lazy+wrapper:$B/qwen2.5-0.5b.safetensors,lazy+wrapper:$QV,lazy+wrapper:$QL"
evaluate qwen05_longform $Q squad $D/squad_v1.1_dev.json $D/retrieval_squad_test_d8.json \
  "full,lazy,lazy+wrapper:$B/qwen2.5-0.5b.safetensors,lazy+wrapper:$QV,lazy+wrapper:$QL" --prompts longform --n 500
evaluate qwen05_amazon $Q amazon_reviews $D/amazon_reviews_v1.0.json $D/retrieval_amazon_reviews_test_d8.json \
  "full,lazy,lazy+wrapper:$B/qwen2.5-0.5b.safetensors,lazy+wrapper:$QV,lazy+wrapper:$QL"
echo "done all"
