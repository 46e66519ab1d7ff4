#!/bin/bash
# Train-step cost of one bench preset under several XLA CPU flag sets, alternating, several rounds.
#   scripts/xla_flag_sweep.sh configs/gpt.py:bench [rounds] [extra launch args...]
# Prints wall tokens/s, CPU ms per step (all threads; steadier than wall time on a shared machine)
# and MFU against the matmul rate measured in the same run, per flag set and round.
config=${1:-configs/gpt.py:bench}
rounds=${2:-2}
shift 2
cd "$(dirname "$0")/.."
mapfile -t flag_sets <<'FLAGS'

--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce
--xla_cpu_use_onednn=true
--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY_SLINKY
--xla_cpu_enable_concurrency_optimized_scheduler=true
FLAGS
for round in $(seq 1 "$rounds"); do
  for flags in "${flag_sets[@]}"; do
    out=$(XLA_FLAGS="$flags" python launch.py --config="$config" --mode=bench --bench_steps=6 --bench_decode=false "$@" \
          2>/dev/null | tail -1)
    python -c "import json,sys; r=json.loads(sys.argv[1]); print(f'round $round {r[\"tokens_per_s\"]:8.1f} tok/s  cpu {r[\"step_cpu_ms\"]:8.1f} ms/step  mfu {r[\"mfu\"]:.3f}  compile {r[\"compile_s\"]:5.1f} s  load $(cut -d' ' -f1 /proc/loadavg)  [{sys.argv[2] or \"defaults\"}]')" "$out" "$flags"
  done
done
