#!/usr/bin/env bash
# Every GPU figure the open issues need, in one device call of under 10 minutes (the steps take ~7.5 min on an H200;
# their timeouts add to 14 min: GPU_CHECKS splits the steps over two calls if a run nears the limit):
#   1. the compression hook's CUDA path (tests/compression/test_cuda.py: NCCL, device futures, residual reset,
#      both exchanges, event timings under Lightning), the topology probe's (tests/parallel/test_cuda.py) and expert
#      parallelism's (tests/parallel/test_expert_cuda.py: NCCL all-to-all dispatch, grouped GEMM in BF16, #15);
#   2. quantize + dequantize throughput next to a device memory copy, eager and compiled (kernels.py, #7);
#   3. FP32 / FP16 / BF16 / staged throughput and final loss at GPT-2 124M size (bench_precision.py, #4);
#   4. FP8 (torchao float8 training, real FP8 GEMMs on compute capability >= 8.9) against BF16 at GPT-2 124M:
#      tokens/s and final loss (bench_fp8_moments.py --part fp8, #20), eager and with each block compiled. Needs
#      torchao on the device machine (it has no network: carry a wheel or site-packages copy); without it the step
#      says so and is skipped. Alone:
#      python3 benchmarks/precision/bench_fp8_moments.py --device cuda --size gpt2-124m --part fp8 --steps 100
#   4b. FP8 against BF16 at a width where FP8 GEMMs can pay (4 layers of 4096, 2048 tokens a sequence), compiled;
#   5. beside them, on 2 of the machine's CPU cores that nothing else uses (taskset 8-15), the cost model's ranking
#      on loopback (bench_cost_model.py, #16): the same benchmark as on the project's 2-core VM, where 2 ranks share
#      the cores with gloo's threads and the host's other guests, on a quiet machine: is the ranking's miss on the
#      VM's near-ties noise or the model? (CPU only; it needs no GPU, only the device machine's idle cores.)
#   6. the pipeline schedules' single-device path (one_device.py, #47): every schedule runs on one GPU, its gradients
#      equal to the plain forward and backward, and its tokens/s beside it.
#   7. lds-plan's compute term: a 1B-class Llama-shaped model, BF16, eager and compiled, one device
#      (planning/compute_efficiency.py, #48): measured FLOP/s over the preset's peak against compute_efficiency=0.4.
#   8. the pipeline bubble measured with one core per rank (bench_bubble.py, #47; CPU only, 4 free cores 4-7): on the
#      2-core VM four ranks share two cores and the measured idle time is not the schedule's.
# GPU_CHECKS picks steps (default: "cost-model tests large pipeline efficiency bubble kernels precision fp8 fp8-wide"; "testbed" only if named).
# At most 8 files come back from the device machine: every step's stderr goes to stderr.log, and at the end every
# output is packed into one archive, $OUT/gpu_checks.tgz (tar xzf it here).
# Usage, from the repository root on the device machine:  bash benchmarks/gpu_checks.sh "$OUT"
# The device image has torch, Lightning and pytest; benchmarks/gpu_pack.sh packs the rest (torchao for step 4; omegaconf
# and hydra for step 5) and shows the call. The latest run's figures: benchmarks/gpu_results/REPORT.md, its raw outputs
# beside it (benchmarks/gpu_results/<device>/).
set -uo pipefail
out=${1:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__,
      torch.cuda.get_device_name())" 2>&1 | tee "$out/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >>"$out/env.txt" 2>&1
# Can the network testbed (benchmarks/testbed.py: namespaces, veth, tc tbf) run on this machine's free cores? (#16)
{ echo "uid $(id -u), $(nproc) cores"; for t in ip tc taskset; do echo "$t: $(command -v $t || echo missing)"; done
  ip netns add ldsprobe && ip netns exec ldsprobe tc qdisc add dev lo root tbf rate 1gbit burst 32kb latency 50ms \
    && echo "netns + tc tbf: ok"; ip netns del ldsprobe; } >>"$out/env.txt" 2>&1
checks=" ${GPU_CHECKS:-cost-model tests large pipeline efficiency bubble kernels precision fp8 fp8-wide} "
want() { [[ $checks == *" $1 "* ]]; }
pin=$(command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ] && echo "taskset -c 8-15")
want cost-model && (OMP_NUM_THREADS=1 timeout 520 $pin python3 benchmarks/autotune/bench_cost_model.py --repeats 6 --steps 20 \
  --models moe,demo,ffn --timeout 500 --json "$out/cost_model_quiet.json" >"$out/cost_model_quiet.md" \
  2>>"$out/stderr.log"; echo "cost model on loopback (${pin:-not pinned}): exit $?" >>"$out/cost_model_quiet.md") &
# Not in the default list, a call of its own: the 2 x 2 network testbed at 1 Gbit on 8 free cores (if env.txt's probe
# says "netns + tc tbf: ok"), the cost model's ranking on a quiet machine where the VM's runs are noisiest (#16).
want testbed && OMP_NUM_THREADS=1 timeout 560 $pin python3 benchmarks/autotune/bench_cost_model.py --testbed \
  --rate 1gbit --repeats 4 --steps 20 --models moe,demo,ffn --timeout 540 --json "$out/cost_model_testbed_quiet.json" \
  >"$out/cost_model_testbed_quiet.md" 2>>"$out/stderr.log"
want tests && timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/compression/test_cuda.py \
  tests/compression/test_fused.py tests/parallel/test_cuda.py tests/parallel/test_expert_cuda.py \
  tests/parallel/test_activation_checkpointing.py 2>&1 | tee "$out/cuda_tests.txt"
# Large models on one device (#51): activation checkpointing under the strategy on CUDA, the run summary's measured
# peak (max_memory_allocated) beside the model-state bytes the setup table predicts.
want large && timeout 180 python3 -c 'import sys; from lightning_deepseek.app.console import train; train()' trainer=gpu trainer.devices=1 strategy=hybrid strategy.tensor_parallel_size=1 \
  strategy.activation_checkpointing=full model=gpt2-124m tune=none compression=none trainer.max_steps=30 \
  hydra.run.dir="$out/large_run" 2>>"$out/stderr.log" | grep -A25 "memory per rank\|run summary" | tee "$out/large.md"
# The pipeline schedules' single-device path (#47): every stage on one rank (NCCL world of one), gradients against the
# plain forward and backward, and what each schedule's bookkeeping costs in tokens/s.
want pipeline && timeout 150 python3 benchmarks/pipeline/one_device.py --device cuda --size gpt2-124m --steps 20 \
  2>>"$out/stderr.log" | tee "$out/pipeline.md"
# lds-plan's compute efficiency on this device (#48): the planner's FLOP count over the measured step and the BF16 peak.
want efficiency && timeout 300 python3 benchmarks/planning/compute_efficiency.py --device cuda --steps 10 \
  2>>"$out/stderr.log" | tee "$out/efficiency.md"
# The pipeline bubble per schedule at 4 stages, one core per rank (CPU; the GPU steps use few cores), beside the
# cost model's run on cores 8-15 (#47: within 10% of each formula?).
bubble_pin=$(command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ] && echo "taskset -c 4-7")
want bubble && OMP_NUM_THREADS=1 timeout 240 $bubble_pin python3 benchmarks/pipeline/bench_bubble.py --microbatches 8 16 \
  --repeats 3 --steps 3 --width 512 --rows 32 2>>"$out/stderr.log" | tee "$out/bubble.md" &
# --compile adds inductor's fused kernel of the plain int8 round trip (the eager int8 round trip reaches 0.11x of a copy)
want kernels && timeout 120 python3 benchmarks/compression/kernels.py --device cuda --numel 67108864 --compile 2>&1 | tee "$out/kernels.md"
want precision && timeout 180 python3 benchmarks/precision/bench_precision.py --device cuda --size gpt2-124m --steps 100 2>>"$out/stderr.log" \
  | tee "$out/precision.md"
if ! python3 -c "import torchao" 2>/dev/null; then
  echo "FP8 checks skipped: torchao is not importable here (pip install 'lightning-deepseek[fp8]')" | tee "$out/fp8.md"
elif want fp8; then
  timeout 80 python3 benchmarks/precision/bench_fp8_moments.py --device cuda --size gpt2-124m --part fp8 --steps 100 \
    2>>"$out/stderr.log" | tee "$out/fp8.md"
  # the same, each block compiled: torchao's float8 is built for torch.compile (eager FP8 ran at 0.24x of BF16)
  timeout 150 python3 benchmarks/precision/bench_fp8_moments.py --device cuda --size gpt2-124m --part fp8 --steps 100 \
    --compile 2>>"$out/stderr.log" | tee -a "$out/fp8.md"
fi
if python3 -c "import torchao" 2>/dev/null && want fp8-wide; then
  timeout 200 python3 benchmarks/precision/bench_fp8_moments.py --device cuda --size gpt2-124m --n-layer 4 --n-head 32 \
    --n-embd 4096 --block-size 2048 --batch-size 8 --steps 40 --skip-steps 5 --val-batches 5 --part fp8 --compile \
    2>>"$out/stderr.log" | tee -a "$out/fp8.md"
fi
wait  # the cost model's run (step 5)
tar czf /tmp/gpu_checks.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/gpu_checks.tgz "$out/"
