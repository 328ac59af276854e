#!/usr/bin/env bash
# Every offline command of the README's job table ('Every job', third column),
# as written and in its order, on the demo's outputs, offline on CPU. The
# commands are read from README.md (scripts/readme_jobs.py), so the table is
# their only copy. Run it after `bash scripts/demo.sh` (it uses .venv and
# demo_out/). Outputs a previous try left (the tables, export and runs the
# commands create) are removed first, so each try runs the commands as a new
# user would; demo_out/table.lance and demo_out/export are the demo's and keep
# what the commands add. Each command's output goes to demo_out/try/<n>.log;
# the summary names each one with its exit status and line count, and the
# script fails if any command did. TRY_DIR=<dir> runs in another folder that
# holds demo_out/ and configs/ (tests/test_readme_jobs.py does, marked slow).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "${TRY_DIR:-$repo}" || exit 2
[ -d demo_out/export ] || { echo "run 'bash scripts/demo.sh' first (no demo_out/export)" >&2; exit 2; }
# shellcheck disable=SC1091
[ -z "${VIRTUAL_ENV:-}" ] && [ -f "$repo/.venv/bin/activate" ] && . "$repo/.venv/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mapfile -t commands < <(python "$repo/scripts/readme_jobs.py")
[ "${#commands[@]}" -gt 0 ] || { echo "no commands found in README.md's job table" >&2; exit 2; }
rm -rf demo_out/try demo_out/more.lance demo_out/urls.lance demo_out/export-2 demo_out/again \
  runs/smoke-cpu runs/smoke-cpu-2 runs/smoke-latent-cpu runs/smoke-latent-cached-cpu
mkdir -p demo_out/try
n=0 failed=0 servers=()
summary=()
trap 'for p in "${servers[@]}"; do kill "$p" 2>/dev/null; done' EXIT
for cmd in "${commands[@]}"; do
  n=$((n + 1))
  log="demo_out/try/$n.log"
  if [[ "$cmd" == *" &" ]]; then  # a server the next commands use: started, not waited on
    eval "${cmd% &}" >"$log" 2>&1 &
    servers+=($!)
    summary+=("$(printf '%3d  started in the background   %s' "$n" "$cmd")")
    echo "${summary[-1]}"
    sleep 1
    continue
  fi
  t0=$SECONDS
  (eval "$cmd") >"$log" 2>&1
  rc=$?
  summary+=("$(printf '%3d  rc=%-3d %4d lines %4ds  %s' "$n" "$rc" "$(wc -l <"$log")" $((SECONDS - t0)) "$cmd")")
  [ "$rc" = 0 ] || failed=$((failed + 1))
  echo "${summary[-1]}"
done

echo
printf '%s\n' "${summary[@]}"
echo "$((n - failed)) of $n commands exited 0 (logs: demo_out/try/)"
[ "$failed" = 0 ]
