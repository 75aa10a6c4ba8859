#!/bin/bash
# The best-2h command (results/best-2h.txt) on an older engine and on this checkout's, for issue 35's rerun
# (results/best-2h-engine.txt). Run it alone, from the repository root:
#
#     OLD=/path/to/a/worktree/at/0666957 studies/best_2h_engine.sh     # OLD has its own .venv (pip install -e .)
#
# 1. 150 s of the best-2h command each (2 workers), old and new engine and new on the loops GEMM path, with the
#    workplace's OPENBLAS_CORETYPE and with it unset; Ctrl-C to the process group, then its progress lines.
# 2. One thread, one expert, 1,000 steps, old and new alternated twice: ms a step after step 100.
set -u
NEW=$(pwd)
best2h=(train --experts 16 --embed 16 --hidden 20 --layers 1 -P 64 --lr 0.599 --steps 34000 --shaping normalize
        --on-divergence restart --seed 0 --workers 2)
for mode in haswell unset; do
  blas=(); [ $mode = unset ] && blas=(-u OPENBLAS_CORETYPE)
  for code in old new loops; do
    dir=$NEW gemm=(); [ $code = old ] && dir=$OLD; [ $code = loops ] && gemm=(ZOSOMA_CPU_GEMM=loops)
    run=$(mktemp -d)
    echo "== $code engine ($(git -C "$dir" rev-parse --short HEAD) ${gemm[*]}), OPENBLAS_CORETYPE=$(env "${blas[@]}" sh -c 'echo ${OPENBLAS_CORETYPE:-unset}')"
    cd "$dir"
    setsid env "${blas[@]}" "${gemm[@]}" .venv/bin/zosoma "${best2h[@]}" --run-dir "$run/run" > "$run/log" 2>&1 &
    pid=$!  # setsid's own process: the leader of the run's process group
    cd "$NEW"
    sleep 150; kill -INT -- -"$pid"; wait "$pid"
    grep "tok/s" "$run/log" | sed 's/^\(\[[0-9:]*\]\).*(smoothed), /\1 /'
    rm -rf "$run"
  done
done
for mode in unset haswell; do
  blas=(); [ $mode = unset ] && blas=(-u OPENBLAS_CORETYPE)
  for rep in 1 2; do
    for code in old new; do
      dir=$NEW; [ $code = old ] && dir=$OLD
      run=$(mktemp -d)
      (cd "$dir" && env "${blas[@]}" OPENBLAS_NUM_THREADS=1 .venv/bin/zosoma train --embed 16 --hidden 20 --layers 1 -P 64 \
        --lr 0.3 --steps 1000 --seed 0 --quiet --run-dir "$run/run" > /dev/null 2>&1)
      "$NEW/.venv/bin/python" - "$run/run" $code $mode <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")][100:]
step = (rows[-1]["wall_s"] - rows[0]["wall_s"]) / (len(rows) - 1)
print(f"{sys.argv[3]:8s} {sys.argv[2]}: {1e3 * step:.2f} ms a step, forward {1e3 * sum(r['forward_s'] for r in rows) / len(rows):.2f} ms")
PY
      rm -rf "$run"
    done
  done
done
