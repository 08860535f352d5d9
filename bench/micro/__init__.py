"""Micro-benchmarks and developer tools: kernel, step and transfer timings, and fault studies of one
component, for whoever changes the code (what an operator runs on a deployment is one level up, in
bench/: `pdserve bench offline|serve|accuracy`, soak.py, migration.py, startup.py).

Sub-commands of `pdserve bench` (bench/cli.py):
    spec-replay      spec_replay.py: what n-gram speculation would accept, replayed from greedy answers
    spec-itl         spec_itl.py: speculative decoding's ITL and acceptance against none, copy-heavy prompts
    spec-overlap     spec_overlap.py: serial against overlapped verify steps, at a set acceptance
    transfer         transfer.py: KV WRITEs between two pools in two processes (flags: transfer_cli.py)

Run as `python -m pdserve.bench.micro.NAME`:
    allreduce               NCCL against symmetric-memory all-reduce inside a CUDA graph, on N GPUs
    decode_step             the steady decode step against its memory floor
    first_requests          a fresh server's first structured requests against the next ones (official client)
    fp8_checkpoints         block-wise FP8 checkpoints in both spellings, written from a tiny model; served
    fp8_gemm                an FP8 linear layer's CUDA paths against bf16, at a Llama shape
    grammar_fill            structured output's host work: token acceptance and mask filling per step
    grammar_step            the decode step with every request under a JSON-schema grammar, and without
    host_step               the host's share of a decode step (scheduling, batch building, results)
    host_tier               the host KV tier's copy bandwidth against the bus's
    otlp_sink               an OTLP/gRPC trace receiver that counts spans (a tracing-cost run's collector)
    overlap                 overlap on vs off: decode inter-token latency at a few batch sizes
    prefill_latency         one prompt's time to first token in the engine: what the host adds
    profile_offline         an offline run's GPU time: kernels by device time, and idle time
    router_memory           a router's processes: memory (RSS, PSS), start time, and whether torch is in them
    rpc_auth                what the cluster secret costs per RPC
    startup_profile         where one server's start-up goes, function by function (cProfile of its engine)
    teacher_forced_engine   the engine's teacher-forced top-1 agreement with transformers, per FP8 setting
    ttft_breakdown          where one request's time to first token goes, hop by hop, through a local stack
    tune_kernels            tuning sweeps of the decode-step kernels
    verify_step             a speculative verify step's cost against the plain decode step
    worker_kill             many streams through a router's workers, one worker SIGKILLed mid-run

Helpers: call_timer.py (transfer --time-calls), copy_workload.py (spec-replay, spec-itl), proc_sockets.py
(worker_kill), drop_kernels.py (decode_step --drop-kernels).
"""
