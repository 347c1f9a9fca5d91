#!/usr/bin/env bash
# kill -9 in the middle of a CUDA run, then `rlake resume`, sync and async (docs/gpu.md): the
# resumed run must end with every iteration trained once, no sample trained twice, the staleness
# bound kept, and held-out accuracy above its start. Run from the project root with
# .gpu-bundle/ beside it (../shared/gpu/README.md); results in $OUT (default ./gpu-out).
# ITERATIONS (20) per run, KILL_AT (9) train_steps commits before the kill, T (150) s per command,
# CONFIG (configs/gpu.yaml), SETS (more --set arguments for both runs).
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
if [ "${BUNDLE:-1}" = 1 ]; then  # BUNDLE=0: a machine with rlake installed (a CPU try)
  export PYTHONPATH=/tmp/site:$PWD
  test -d /tmp/site/deltalake || { mkdir -p /tmp/site && tar -xJf .gpu-bundle/part1.tar.xz -C /tmp/site; }
  test -d /tmp/site/prefect || tar -xJf .gpu-bundle/part2.tar.xz -C /tmp/site
fi
ITERATIONS=${ITERATIONS:-20}; KILL_AT=${KILL_AT:-9}; T=${T:-150}; CONFIG=${CONFIG:-configs/gpu.yaml}
read -r -a SETS <<< "${SETS:-}"  # more "--set k=v" for both runs (a CPU try: the SFT checkpoint)

sql() { python3 -m infra.cli sql "$2" --lake "$1/lake" -f csv; }

crash_and_resume() {  # name, then extra --set arguments
  local name=$1; shift
  local home=/tmp/crash-$name log="$OUT/crash-$name.txt"
  rm -rf "$home"
  local s=$SECONDS
  setsid python3 -m infra.cli run "$CONFIG" --run-id "$name" --set home="$home" \
    --set num_rollout="$ITERATIONS" --set save_interval=5 "${SETS[@]}" "$@" > "$log" 2>&1 &
  local pid=$!
  until [ "$(ls "$home"/lake/train_steps/_delta_log/*.json 2>/dev/null | wc -l)" -ge "$KILL_AT" ]; do
    kill -0 $pid 2>/dev/null || break
    [ $((SECONDS - s)) -gt "$T" ] && break
    sleep 0.2
  done
  kill -9 -- -$pid 2>/dev/null; wait $pid 2>/dev/null
  echo "killed after $((SECONDS - s)) s at $(ls "$home"/lake/train_steps/_delta_log/*.json | wc -l) train_steps commits" | tee -a "$log"
  s=$SECONDS
  timeout "$T" python3 -m infra.cli resume "$name" --home "$home" >> "$log" 2>&1
  echo "resume rc=$? $((SECONDS - s)) s" | tee -a "$log"
  {
    echo "-- steps: rows, distinct steps, distinct produced versions, max staleness"
    sql "$home" "select count(*) n, count(distinct step) steps, count(distinct weight_version) versions, max(staleness_max) staleness from train_steps where run_id = '$name'"
    echo "-- samples trained more than once"
    sql "$home" "select count(*) twice from (select u from (select unnest(sample_uids) u from train_steps where run_id = '$name') group by u having count(*) > 1)"
    echo "-- train samples generated, consumed"
    sql "$home" "select (select count(*) from trajectories where run_id = '$name' and kind = 'train') generated, (select count(*) from (select unnest(sample_uids) from train_steps where run_id = '$name')) consumed"
    echo "-- held-out accuracy by weight version"
    sql "$home" "select weight_version, value from evals where run_id = '$name' and metric = 'accuracy' order by weight_version"
  } 2>&1 | tee -a "$log"
}

date -u > "$OUT"/crash-info.txt
crash_and_resume sync
crash_and_resume async --set mode=async --set trainer.max_staleness=1
