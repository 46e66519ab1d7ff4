#!/bin/bash
# Train-step speed of one bench preset under several XLA CPU flag sets, one run each, in turn.
#   scripts/xla_flag_sweep.sh configs/gpt.py:bench
# Prints tokens/s and MFU (against the matmul rate measured in the same run, which absorbs some of a
# shared machine's drift) per flag set.
config=${1:-configs/gpt.py:bench}
cd "$(dirname "$0")/.."
while read -r flags; do
  out=$(XLA_FLAGS="$flags" python launch.py --config="$config" --mode=bench --bench_steps=6 --bench_decode=false 2>/dev/null | tail -1)
  python -c "import json,sys; r=json.loads(sys.argv[1]); print(f'{r[\"tokens_per_s\"]:8.1f} tok/s  mfu {r[\"mfu\"]:.3f}  compile {r[\"compile_s\"]:5.1f} s  load $(cut -d' ' -f1 /proc/loadavg)  [{sys.argv[2] or \"defaults\"}]')" "$out" "$flags"
done <<'FLAGS'

--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce
--xla_cpu_use_onednn=true
--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY_SLINKY
--xla_cpu_enable_concurrency_optimized_scheduler=true
FLAGS
