"""The WAR race the barrier exists for, made visible.

After launching forward N+1 the loop processes N; a request F that finished at N gives back its
req_to_token row, and the next scheduling step writes a waiting request's slots into that row (on
the schedule stream) while forward N+1, which still includes F, may be reading it. Forward N+1's
token for F is discarded by design, so the test records every sampled token, discarded ones too,
and compares each with what F would sample at that step (a serial run without F's stop). With
the barrier `schedule_stream.wait_stream(forward_stream)` they agree; with it switched off and the
forward stream slowed down, F's in-flight step reads a row already rewritten and diverges.
"""

import random

import torch

from pdserve.common.engine.engine import Engine
from pdserve.common.types import SamplingParams

NUM_REQS, ROWS, MAX_NEW = 24, 4, 24


def record_all_samples(engine):
    """(rid, step) -> token for every sampled token, including those the loop discards."""
    sampled, steps_of = {}, {}
    launch, process = engine.run_batch, engine.scheduler.process_batch_result

    def recording_launch(batch):
        steps = [(r.rid, r.num_sampled) if s else None for r, s in zip(batch.reqs, batch.samples)]
        result = launch(batch)
        steps_of[batch.seq] = steps
        return result

    def recording_process(batch, next_ids, logprobs):
        for step, token in zip(steps_of.pop(batch.seq), next_ids):
            if step is not None:
                sampled[step] = token
        return process(batch, next_ids, logprobs)

    engine.run_batch, engine.scheduler.process_batch_result = recording_launch, recording_process
    return sampled


def run(path, prompts, params, barrier, sleep_cycles):
    engine = Engine(
        model_path=path, device="cuda", dtype="float32", max_running_requests=ROWS, max_total_tokens=8192, page_size=4
    )
    if not barrier:  # the loop's schedule_stream.wait_stream(forward_stream) does nothing
        engine.streams.schedule_stream.wait_stream = lambda stream: None
    engine.runner.before_forward = lambda batch: torch.cuda._sleep(sleep_cycles)
    sampled = record_all_samples(engine)
    outs = engine.generate(prompts, params)
    assert engine.is_idle()
    return {o.rid: o.output_ids for o in outs}, sampled, engine


def test_barrier_prevents_the_race_and_its_absence_is_detected(tiny_models):
    path = tiny_models("llama")
    rng = random.Random(5)
    prompts = [[0] + [rng.randrange(5, 512) for _ in range(rng.randrange(20, 60))] for _ in range(NUM_REQS)]
    free_run = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    reference = Engine(
        model_path=path, device="cuda", dtype="float32", max_total_tokens=8192, disable_overlap_schedule=True
    ).generate(prompts, free_run)
    ref = {f"req-{i}": c.output_ids for i, c in enumerate(reference)}
    # Each request stops on a token it first samples at step 3..12: it finishes early, with its
    # next step already in flight, and the waiting queue takes its row at once.
    params = []
    for c in reference:
        k = next(k for k in range(3 + len(params) % 10, MAX_NEW - 1) if c.output_ids[k] not in c.output_ids[:k])
        params.append(
            SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, stop_token_ids=(c.output_ids[k],))
        )

    def mismatches(sampled):
        return [(rid, step) for (rid, step), tok in sampled.items() if ref[rid][step] != tok]

    outs, sampled, _ = run(path, prompts, params, barrier=True, sleep_cycles=20_000_000)
    discarded = [(rid, step) for rid, step in sampled if step >= len(outs[rid])]
    print(
        f"\nbarrier on: {len(sampled)} samples, {len(discarded)} discarded in-flight steps, "
        f"{len(mismatches(sampled))} differ from the reference"
    )
    assert len(discarded) >= NUM_REQS // 2, "the scenario never put a finished request's next step in flight"
    assert not mismatches(sampled)
    assert all(outs[rid] == ref[rid][: len(outs[rid])] for rid in outs)

    _, sampled_off, _ = run(path, prompts, params, barrier=False, sleep_cycles=20_000_000)
    bad = mismatches(sampled_off)
    print(f"barrier off: {len(bad)} of {len(sampled_off)} samples differ from the reference: {bad[:8]}")
    assert bad, "without the barrier the race should corrupt an in-flight step"
