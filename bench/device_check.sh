#!/usr/bin/env bash
# The checks that need a GPU, in one run of at most ~8 minutes on one device, ending in one table:
#   1. the agent's overhead on a GPT-like model (default configuration and every metric every step),
#   2. FSDP2 on one rank (NCCL, a world of one) with the agent: its global gradient norm against
#      clip_grad_norm_'s (report steps, and ordinary steps' from the flat gradient buffers through
#      the interval's largest), and the agent's share of the step,
#   3. the agent's operators and CUDA kernel launches per step and per report step against the
#      tensor count (bench/agent_scale.py), alone and under DDP with gradient_as_bucket_view (one rank),
#   4. the reaction latency of the closed loop (controller + 2 gloo ranks; CPU-side, here for one table),
#   5. the CUDA tests (tests/*/test_*cuda*.py).
# Each part has its own time limit; a part that fails or runs out of time is marked and the rest go on.
# On a machine without CUDA it says so and exits 0: nothing here can run there.
#
#   bash bench/device_check.sh            # from the repository root, with the project's .venv
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "device_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check."
    echo "device_check: run it where a GPU is lent; every test and benchmark of the suite runs on the CPU."
    exit 0
fi
"$PY" -c 'import torch; print("device_check:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

rows=()
part() {  # part NAME LIMIT_S SUMMARY_REGEX -- command...
    local name=$1 limit=$2 pattern=$3; shift 4
    local log="$OUT/${name// /_}.log" start=$SECONDS rc
    echo "== $name (limit ${limit} s)"
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    local status=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="timed out"
    [ $rc -ne 0 ] && [ "$status" = ok ] && status="failed (rc $rc)"
    local summary
    summary=$(grep -E "$pattern" "$log" | tail -n 3 | tr '\n' ';' | tr -s ' ' | cut -c1-160)
    rows+=("$(printf '%-22s | %-16s | %4d s | %s' "$name" "$status" $((SECONDS - start)) "$summary")")
}

part "agent overhead" 150 "default|every metric" -- \
    "$PY" bench/agent_overhead.py --device cuda --steps 12 --warmup 2

part "fsdp2 one rank" 90 "fsdp2" -- "$PY" - <<'EOF'
import os, tempfile, time
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import trainer_agent as ta

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(8)]).cuda()
    for block in model:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # report_every 5: the ordinary steps take the norm from FSDP2's flat gradient buffers
    # (trainer_agent/measure/fsdp_grad_buffers.py), the report steps per tensor.
    agent = ta.attach(model, opt, job="device-check", run="fsdp2", config=ta.AgentConfig(metrics_port=None, report_every=5))
    x = torch.randn(32, 1024, device="cuda")
    worst, times, refs = 0.0, [], []
    for step in range(1, 26):
        t0 = time.perf_counter()
        loss = model(x + 0.01 * step).square().mean()
        loss.backward()
        refs.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).full_tensor().item())
        opt.step(); opt.zero_grad()
        agent.end_step(loss)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if step % 5 == 0:  # the report step's norm, and its interval's largest (ordinary steps included)
            latest = agent.latest()
            for got, ref in ((latest.get("trainguard_grad_norm", float("nan")), refs[-1]),
                             (latest.get("trainguard_grad_norm_max", float("nan")), max(refs[-5:]))):
                worst = max(worst, abs(got - ref) / ref)
    share = agent.overhead_seconds_total / sum(times)
    used = agent.parts.params.bucket_views.used if agent.parts.params.bucket_views is not None else 0
    print(f"fsdp2 1 rank: grad_norm and interval max vs clip_grad_norm_ worst rel diff {worst:.2e}; "
          f"{used} of 20 ordinary steps from the flat buffers; agent {share:.1%} of wall time (host)")
    agent.close()
    dist.destroy_process_group()
EOF

part "ops and kernels" 120 "^[0-9,]+ \|" -- \
    "$PY" bench/agent_scale.py --device cuda --tensors 100 1000 5000 --rounds 1 --elements 4000000

part "ddp bucket kernels" 60 "^[0-9,]+ \|" -- \
    "$PY" bench/agent_scale.py --device cuda --ddp --bucket-view --tensors 100 5000 --rounds 1 --elements 4000000

part "fingerprint kernels" 40 "^[0-9,]+ \|" -- \
    "$PY" bench/fingerprint_projection.py --device cuda --tensors 100 5000 --rounds 3

part "reaction latency" 100 "median|steps" -- \
    "$PY" bench/reaction_latency.py --trials 3 --rounds 2 --steps 20

part "cuda tests" 150 "passed|failed|error" -- \
    "$PY" -m pytest -q -p no:cacheprovider tests/agent/test_agent_cuda.py tests/control/test_control_cuda.py \
    tests/data/test_data_cuda.py "tests/agent/test_staged.py::test_staged_passes_on_cuda_match_the_fused_ones"

echo
echo "device_check summary (logs in $OUT)"
printf '%-22s | %-16s | %6s | %s\n' "part" "status" "time" "figures"
for r in "${rows[@]}"; do echo "$r"; done
