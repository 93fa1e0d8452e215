#!/usr/bin/env bash
# miles fully-async GRPO (Qwen3-30B-A3B, one 8-GPU node) with weightbus in charge of the weight versions.
#
# Arguments only: this is miles' own fully-async recipe (examples/infra_features/fully_async in miles) plus
# the three weightbus flags and two environment variables. Run it from a miles checkout, in an image where
# `pip install weightbus` was done (training actors and RolloutManager alike), with a Ray cluster up.
#
#   MILES_DIR=~/miles MODEL_DIR=/models DATA_DIR=/data ./run_fully_async_weightbus.sh
#
# Without WEIGHTBUS_NATS it starts a local embedded NATS (`weightbus server`) for a single-node run.
# Watch it from another shell:  weightbus watch    and    weightbus status --policy "$WEIGHTBUS_POLICY"
set -euo pipefail

: "${MILES_DIR:?set MILES_DIR to a miles checkout}"
: "${MODEL_DIR:?set MODEL_DIR (holds Qwen3-30B-A3B and its torch_dist conversion)}"
: "${DATA_DIR:?set DATA_DIR (holds dapo-math-17k)}"
MODEL=${MODEL:-Qwen3-30B-A3B}
TRANSFER_MODE=${TRANSFER_MODE:-broadcast}   # broadcast | p2p (weightbus takes over both, and disk delta)
PAUSE_MODE=${PAUSE_MODE:-in_place}          # miles' fully-async e2e mode
export WEIGHTBUS_POLICY=${WEIGHTBUS_POLICY:-qwen3-30b-a3b-grpo}

if [[ -z "${WEIGHTBUS_NATS:-}" ]]; then
  export WEIGHTBUS_NATS=nats://127.0.0.1:4333
  weightbus server --port 4333 --store "${WEIGHTBUS_STORE:-/tmp/weightbus-js}" &
  trap 'kill %1' EXIT
  sleep 2
fi

cd "$MILES_DIR"
ray job submit --address "${RAY_ADDRESS:-http://127.0.0.1:8265}" \
  --runtime-env-json "{\"env_vars\": {\"WEIGHTBUS_NATS\": \"$WEIGHTBUS_NATS\", \"WEIGHTBUS_POLICY\": \"$WEIGHTBUS_POLICY\"}}" \
  -- python train_async.py \
  --custom-megatron-init-path weightbus.integrations.miles.install \
  --custom-async-data-buffer-path weightbus.integrations.miles.WeightbusDataBuffer \
  --custom-generate-function-path weightbus.integrations.miles.generate \
  --max-weight-staleness 2 \
  --async-unused-samples-handler retry \
  --fully-async \
  --hf-checkpoint "$MODEL_DIR/$MODEL/" \
  --ref-load "$MODEL_DIR/${MODEL}_torch_dist" \
  --load "$MODEL_DIR/${MODEL}_miles/" \
  --save "$MODEL_DIR/${MODEL}_miles/" \
  --prompt-data "$DATA_DIR/dapo-math-17k/dapo-math-17k.jsonl" \
  --input-key prompt --label-key label --apply-chat-template --rollout-shuffle \
  --rm-type dapo --reward-key score \
  --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 \
  --rollout-max-response-len 8192 --rollout-temperature 1 \
  --global-batch-size 256 --balance-data \
  --pause-generation-mode "$PAUSE_MODE" \
  --update-weight-transfer-mode "$TRANSFER_MODE" \
  --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 1 \
  --context-parallel-size 1 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --use-dynamic-batch-size --max-tokens-per-gpu 9216 \
  --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer \
  --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl \
  --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --use-tis \
  --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98 \
  --rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-cuda-graph-max-bs 512 \
  --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 \
  --attention-backend flash \
  --actor-num-nodes 1 --actor-num-gpus-per-node 8 --num-gpus-per-node 8 --rollout-num-gpus 8
