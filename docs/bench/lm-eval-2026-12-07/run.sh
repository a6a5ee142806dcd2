#!/usr/bin/env bash
# lm-evaluation-harness on the quiz of items.jsonl, twice: through a running `dartspec serve` (local-completions:
# echo + logprobs, batches of token-id prompts; and greedy answers with five stop strings) and on transformers itself
# (hf, float32); compare.py then compares every answer's log-likelihood and every written answer. LM_EVAL: an lm_eval
# from its own virtual environment (it pins its own packages).
# Usage: dartspec serve --port 8011 &   then   LM_EVAL=/tmp/lmeval/bin/lm_eval bash run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
model="${MODEL_DIR:-$HOME/.cache/dartspec/models/smollm2-135m}"
url="${URL:-http://127.0.0.1:8011/v1/completions}"
tasks="$(mktemp -d)"
for task in dartspec_quiz dartspec_quiz_gen; do
  sed "s|ITEMS|$here/items.jsonl|" "$here/$task.yaml" > "$tasks/$task.yaml"
done
out="${OUT:-$here/results}"
"$LM_EVAL" run --model local-completions --tasks dartspec_quiz,dartspec_quiz_gen --include_path "$tasks" --log_samples \
  --model_args "model=smollm2-135m,base_url=$url,tokenizer=$model,num_concurrent=1,max_retries=1" --batch_size 4 \
  --output_path "$out/dartspec"
"$LM_EVAL" run --model hf --tasks dartspec_quiz,dartspec_quiz_gen --include_path "$tasks" --log_samples \
  --model_args "pretrained=$model,dtype=float32" --device cpu --output_path "$out/hf"
