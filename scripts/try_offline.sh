#!/usr/bin/env bash
# Every command of the README's job table, in its order, on the demo's outputs,
# offline on CPU; then both smoke configs under `composer -n 2`. Run it after
# `bash scripts/demo.sh` (it uses .venv and demo_out/). Each command's output
# goes to demo_out/try/<n>.log; the summary names each one with its exit
# status and line count, and the script fails if any command did.
# tests/test_readme_jobs.py checks that every job of the table is run here.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -d demo_out/export ] || { echo "run 'bash scripts/demo.sh' first (no demo_out/export)" >&2; exit 2; }
# shellcheck disable=SC1091
[ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p demo_out/try
n=0 failed=0
summary=()
step() {  # step CMD...: run one command, record its exit status and line count
  n=$((n + 1))
  local log="demo_out/try/$n.log" t0=$SECONDS
  "$@" >"$log" 2>&1
  local rc=$?
  summary+=("$(printf '%3d  rc=%-3d %4d lines %4ds  %s' "$n" "$rc" "$(wc -l <"$log")" $((SECONDS - t0)) "$*")")
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "${summary[-1]}"
}

step python -m prx_data.ingest more=demo_out/src --table demo_out/more.lance
python -m http.server 8765 -b 127.0.0.1 -d demo_out/src >/dev/null 2>&1 &
server=$!
trap 'kill $server 2>/dev/null' EXIT
step python -m prx_data.ingest demo_out/urls.parquet --table demo_out/urls.lance
step python -m prx_data.download --table demo_out/urls.lance --allow-private 127.0.0.1:8765
step python -m prx_data.table stats demo_out/table.lance
step python -m prx_data.search --table demo_out/table.lance --build-indexes photo
step python -m prx_data.stats --table demo_out/table.lance --out demo_out/stats
step python -m prx_data.explore --table demo_out/table.lance --check
step python -m prx_data.quality --table demo_out/table.lance
step python -m prx_data.caption --table demo_out/table.lance --backend transformers --model demo_out/tiny-vlm --max-tokens 16 --limit 8
step python -m prx_data.caption --table demo_out/table.lance --backend transformers --model demo_out/tiny-vlm --max-tokens 16 --limit 8 --schema attributes
step python -m prx_data.classify --table demo_out/table.lance --backend transformers --model demo_out/tiny-lm --max-tokens 8
step python -m prx_data.score clip --table demo_out/table.lance --model demo_out/tiny-clip --engine local
step python -m prx_data.score aesthetic --table demo_out/table.lance --model demo_out/tiny-aesthetic.safetensors --engine local
step python -m prx_data.score watermark --table demo_out/table.lance --model demo_out/tiny-watermark --engine local
step python -m prx_data.score nsfw --table demo_out/table.lance --model demo_out/tiny-nsfw --engine local
step python -m prx_data.dedup --table demo_out/table.lance --export demo_out/export --engine local
step python -m prx_data.semdedup --table demo_out/table.lance --engine local
step python -m prx_data.optout --export demo_out/export --name optout-demo --ids demo_out/optout.txt
step python -m prx_data.latents demo_out/export --vae demo_out/tiny-vae --tiers 512
step python -m prx_data.attach demo_out/export --table demo_out/table.lance --columns source,format
step python -m prx_data.write_mds --table demo_out/table.lance --out demo_out/export-2 --overwrite
step python -m prx_data.adopt demo_out/plain-mds
step python -m prx_data.verify demo_out/export --deep
step python -m prx_data.skips stats demo_out/export
step python -m prx_data.planner --config configs/train/smoke_cpu.yaml --world-size 2
step python -m prx_data.jpeg_fidelity --folder demo_out/src
run=try-$(date +%s)  # fresh run names: a finished run would only say "already finished"
step python -m prx_data.train configs/train/smoke_cpu.yaml variables.run_name="$run-1"
step composer -n 2 -m prx_data.train configs/train/smoke_cpu.yaml variables.run_name="$run-2"
step composer -n 2 -m prx_data.train configs/train/smoke_latent_cpu.yaml variables.run_name="$run-3"
step composer -n 2 -m prx_data.train configs/train/smoke_latent_cached_cpu.yaml variables.run_name="$run-4"
step python -m prx_data.demo --workdir demo_out/again  # demo_out/table.lance now holds the columns above

echo
printf '%s\n' "${summary[@]}"
echo "$((n - failed)) of $n commands exited 0 (logs: demo_out/try/)"
[ "$failed" = 0 ]
