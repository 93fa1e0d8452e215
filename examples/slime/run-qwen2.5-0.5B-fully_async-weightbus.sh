#!/bin/bash
# slime's tiny fully-async GRPO example (examples/fully_async/run-qwen2.5-0.5B-fully_async.sh in slime,
# Qwen2.5-0.5B-Instruct on dapo-math-17k, one 4-GPU node) with weightbus judging, pacing and aborting its
# rollouts. Arguments only: slime's own recipe plus the weightbus flags and variables (docs/integrations/slime.md).
# Run it from a slime checkout, in an image where `pip install weightbus` was done.
#
#   SLIME_DIR=~/slime ./run-qwen2.5-0.5B-fully_async-weightbus.sh
#
# Without WEIGHTBUS_NATS it starts a local embedded NATS (`weightbus server`) for this single-node run.
# Watch it from another shell:  weightbus watch    and    weightbus status --policy "$WEIGHTBUS_POLICY"
set -ex

: "${SLIME_DIR:?set SLIME_DIR to a slime checkout}"
export PYTHONUNBUFFERED=1
export WEIGHTBUS_POLICY=${WEIGHTBUS_POLICY:-qwen2.5-0.5b-grpo}
export WEIGHTBUS_MAX_STALENESS=${WEIGHTBUS_MAX_STALENESS:-2}
export WEIGHTBUS_METRICS_PORT=${WEIGHTBUS_METRICS_PORT:-9103}
if [[ -z "${WEIGHTBUS_NATS:-}" ]]; then
  export WEIGHTBUS_NATS=nats://127.0.0.1:4333
  weightbus server --port 4333 --store "${WEIGHTBUS_STORE:-/tmp/weightbus-js}" &
  trap 'kill %1' EXIT
  sleep 2
fi

cd "$SLIME_DIR"
source "scripts/models/qwen2.5-0.5B.sh"
MODEL_DIR=${MODEL_DIR:-/root/models/Qwen2.5-0.5B-Instruct}
DATA_PATH=${DATA_PATH:-/root/datasets/dapo-math-17k/dapo-math-17k.jsonl}

CKPT_ARGS=(
   --hf-checkpoint "${MODEL_DIR}"
   --ref-load "${MODEL_DIR}_torch_dist"
   --save /tmp/slime_fully_async_weightbus/
   --save-interval 9999
)

WEIGHTBUS_ARGS=(
   # the trainer half: every updater's number from the bus's fenced counter, stamped and read back
   --custom-megatron-init-path weightbus.integrations.slime.install
   # the rollout half: slime's fully-async rollout, judged by the bound and paced at its top-up
   --rollout-function-path weightbus.integrations.slime.generate_rollout
   # early abort of requests that can no longer be fresh (wraps slime's own generate)
   --custom-generate-function-path weightbus.integrations.slime.generate
)

ROLLOUT_ARGS=(
   --prompt-data "${DATA_PATH}"
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --rm-type deepscaler
   --num-rollout 3
   --rollout-batch-size 8
   --n-samples-per-prompt 4
   --rollout-max-response-len 1024
   --rollout-temperature 1
   --global-batch-size 32
   --balance-data
)

PERF_ARGS=(
   --tensor-model-parallel-size 1
   --sequence-parallel
   --pipeline-model-parallel-size 1
   --context-parallel-size 1
   --expert-model-parallel-size 1
   --expert-tensor-parallel-size 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 4096
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --entropy-coef 0.00
   --eps-clip 0.2
   --eps-clip-high 0.28
)

OPTIMIZER_ARGS=(
   --optimizer adam
   --lr 1e-6
   --lr-decay-style constant
   --weight-decay 0.1
   --adam-beta1 0.9
   --adam-beta2 0.98
)

SGLANG_ARGS=(
   --rollout-num-gpus-per-engine 1
   --sglang-mem-fraction-static 0.55
)

MISC_ARGS=(
   --attention-dropout 0.0
   --hidden-dropout 0.0
   --accumulate-allreduce-grads-in-fp32
   --attention-softmax-in-fp32
   --attention-backend flash
)

NUM_GPUS=${NUM_GPUS:-4}
export MASTER_ADDR=${MASTER_ADDR:-"127.0.0.1"}
ray start --head --node-ip-address "${MASTER_ADDR}" --num-gpus "${NUM_GPUS}" --disable-usage-stats

# The weightbus variables must reach the RolloutManager's worker.
RUNTIME_ENV_JSON="{
  \"env_vars\": {
    \"PYTHONPATH\": \"/root/Megatron-LM/\",
    \"CUDA_DEVICE_MAX_CONNECTIONS\": \"1\",
    \"WEIGHTBUS_NATS\": \"${WEIGHTBUS_NATS}\",
    \"WEIGHTBUS_POLICY\": \"${WEIGHTBUS_POLICY}\",
    \"WEIGHTBUS_MAX_STALENESS\": \"${WEIGHTBUS_MAX_STALENESS}\",
    \"WEIGHTBUS_METRICS_PORT\": \"${WEIGHTBUS_METRICS_PORT}\"
  }
}"

ACTOR_GPUS=${ACTOR_GPUS:-1}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-$((NUM_GPUS - ACTOR_GPUS))}

ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json="${RUNTIME_ENV_JSON}" \
   -- python3 train_async.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node "${ACTOR_GPUS}" \
   --rollout-num-gpus "${ROLLOUT_GPUS}" \
   ${MODEL_ARGS[@]} \
   "${CKPT_ARGS[@]}" \
   "${WEIGHTBUS_ARGS[@]}" \
   "${ROLLOUT_ARGS[@]}" \
   "${OPTIMIZER_ARGS[@]}" \
   "${GRPO_ARGS[@]}" \
   "${PERF_ARGS[@]}" \
   "${SGLANG_ARGS[@]}" \
   "${MISC_ARGS[@]}"
