#!/usr/bin/env bash
# The same with curl: a plain request, then the denoising stream (-N: print the events as they come).
set -euo pipefail
BASE_URL="${UNMASK_BASE_URL:-http://127.0.0.1:8000/v1}"
KEY="${UNMASK_API_KEY:-not-needed}"
MODEL="$(curl -sf "$BASE_URL/models" -H "Authorization: Bearer $KEY" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"

curl -sf "$BASE_URL/chat/completions" -H "Authorization: Bearer $KEY" -H 'content-type: application/json' -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Name three colours."}],
  "max_tokens": 16, "temperature": 0, "block_size": 2, "steps": 8}'
echo

curl -sfN "$BASE_URL/chat/completions" -H "Authorization: Bearer $KEY" -H 'content-type: application/json' -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": true,
  "stream_options": {"include_denoising": true, "include_usage": true}}'
