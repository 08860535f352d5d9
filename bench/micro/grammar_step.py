"""The decode step with every request under a JSON-schema grammar, against the same step without.

    python -m pdserve.bench.micro.grammar_step --random-weights llama/1b --batch-size 128

B prompts of --input-len random tokens run for --output-len tokens, greedy, in the overlapped loop,
once per repeat plain (ignore_eos) and once with every request under each of SCHEMAS, arrays of
records that cannot be complete within --output-len tokens (so every run decodes as many steps). The
step is the interval between consecutive decode launches (what a client sees as inter-token
latency: host work the overlap cannot hide shows up in it), median over the decode steps of all
repeats, and the ratio; also where a step's time goes (LoopTimer).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

# Two schemas, each an array of records that cannot be complete within --output-len tokens:
# "records" is what JSON-schema outputs are usually made of (keys, strings, ranged integers, enums,
# numbers, a nested array); "bounded" gives every string a maxLength, the costly case for xgrammar
# (a state near the bound fills its mask in ~0.9 ms on a 128k vocabulary, against a few us).
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "name": {"type": "string"},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["id", "name", "role", "score", "tags"],
}
BOUNDED = json.loads(json.dumps(RECORD))
BOUNDED["properties"]["name"]["maxLength"] = 12
BOUNDED["properties"]["tags"]["items"]["maxLength"] = 8
SCHEMAS = {
    "records": {"type": "array", "items": RECORD, "minItems": 10000},
    "bounded": {"type": "array", "items": BOUNDED, "minItems": 10000},
}


class LoopTimer:
    """Stamps every decode launch of an engine, and times the host's parts of each step: mask
    filling, result processing (the matchers accept there), the launches; and on CUDA the device
    time of the sampling (events around it on the forward stream)."""

    HOST_PARTS = ("grammar_bitmask", "process_batch_result", "run_batch", "sample_deferred")

    def __init__(self, engine):
        self.stamps: list[float] = []
        self.host_s = dict.fromkeys(self.HOST_PARTS, 0.0)
        self.events: dict[str, list] = {"device_forward": [], "device_sample": []}
        for name in self.HOST_PARTS:
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        self.chain: list[tuple[str, float, float]] = []
        self._watch_chain(engine)
        runner = engine.runner
        if runner.device.type == "cuda":
            for name, method in (("device_forward", "launch_forward"), ("device_sample", "launch_sample")):
                setattr(
                    runner, method, self._device_timed(name, getattr(runner, method), runner.streams.forward_stream)
                )

    def _watch_chain(self, engine) -> None:
        """Stamp the links between one batch's tokens reaching the host and the next batch's
        sampling: the loop thread handing them to the grammar worker (Grammars.accept_and_fill),
        waiting for its masks (MaskFuture.result), and the sampling's launch."""
        from pdserve.common.engine import grammar

        grammars = engine.grammars

        def stamped(kind, method):
            def call(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    self.chain.append((kind, start, time.perf_counter()))

            return call

        grammars.accept_and_fill = stamped("handoff", grammars.accept_and_fill)
        grammar.MaskFuture.result = stamped("wait", grammar.MaskFuture.result)  # (this process only)
        engine.sample_deferred = stamped("launch", engine.sample_deferred)

    def chain_ms(self) -> dict[str, float]:
        """Medians over the steps, in ms: handoff (the loop thread's part), loop_ready (handed
        over → the loop thread asks for the masks), wait (for the worker, once asked),
        launch_after_wait (masks in hand → the sampling launched), chain (tokens on the host →
        the next sampling launched)."""
        links: dict[str, list[float]] = {}
        events = sorted(self.chain, key=lambda e: e[1])
        for i, (kind, a, b) in enumerate(events):
            if kind != "handoff":
                continue
            launch = next((e for e in events[i + 1 :] if e[0] == "launch"), None)
            wait = next((e for e in events[i + 1 :] if e[0] == "wait"), None)
            if launch is None or wait is None:
                continue
            for name, value in (
                ("handoff", b - a),
                ("loop_ready", launch[1] - b),
                ("wait", wait[2] - wait[1]),
                ("launch_after_wait", launch[2] - wait[2]),
                ("chain", launch[2] - a),
            ):
                links.setdefault(name, []).append(value * 1e3)
        return {name: statistics.median(values) for name, values in links.items()}

    def _device_timed(self, name, launch, stream):
        def timed(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            result = launch(*args, **kwargs)
            end.record(stream)
            if args[0].mode.value == "decode":
                self.events[name].append((start, end))
            return result

        return timed

    def _timed(self, name, method):
        def timed(*args, **kwargs):
            if name == "run_batch" and args[0].mode.value == "decode":
                self.stamps.append(time.perf_counter())
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.host_s[name] += time.perf_counter() - start

        return timed

    def run(self, engine, prompts, params) -> tuple[list[float], dict[str, float]]:
        """(loop step intervals in ms, ms per decode step of each host part and of the sampling on
        the device) of one run."""
        self.stamps.clear()
        for events in self.events.values():
            events.clear()
        self.host_s = dict.fromkeys(self.HOST_PARTS, 0.0)
        self.chain.clear()
        outs = engine.generate(prompts, params)
        assert all(len(o.output_ids) == params.max_new_tokens for o in outs), "a request stopped early"
        steps = [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]
        per_step = {name: s * 1e3 / max(1, len(self.stamps)) for name, s in self.host_s.items()}
        if self.events["device_sample"]:
            torch.cuda.synchronize()
        for name, events in self.events.items():
            if events:  # (a forward's start fires when the device reaches it: its span is the device's)
                per_step[name] = statistics.median(a.elapsed_time(b) for a, b in events[2:])
        per_step.update({f"chain_{name}": ms for name, ms in self.chain_ms().items()})
        return steps[2:], per_step  # the batch is in after 2 steps


def main() -> None:
    from pdserve.bench.random_weights import add_model_args, model_path_from_args
    from pdserve.common.engine.engine import Engine
    from pdserve.common.types import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--fill-threads",
        type=int,
        default=None,
        help="Threads that fill the masks (common/engine/grammar.FILL_THREADS; default: its value).",
    )
    ap.add_argument(
        "--gil-switch-ms",
        type=float,
        default=None,
        help="Set the process's GIL switch interval (CPython's default: 5 ms).",
    )
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run).")
    ap.add_argument("--json", help="Also write the result here.")
    args = ap.parse_args()

    import pdserve.common.engine.grammar as grammar

    if args.fill_threads is not None:
        grammar.FILL_THREADS = args.fill_threads
    if args.gil_switch_ms is not None:
        sys.setswitchinterval(args.gil_switch_ms / 1e3)
    path = model_path_from_args(args)
    bs, ctx = args.batch_size, args.input_len + args.output_len
    engine = Engine(
        model_path=str(path),
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        max_running_requests=bs,
        max_total_tokens=bs * (ctx + 16),
        context_length=ctx + 16,
        disable_radix_cache=True,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(5, engine.vocab_size) for _ in range(args.input_len)] for _ in range(bs)]
    modes = {"plain": SamplingParams(max_new_tokens=args.output_len, temperature=0, ignore_eos=True)}
    compile_ms = {}
    for name, schema in SCHEMAS.items():
        grammar = ("json_schema", json.dumps(schema))
        start = time.perf_counter()
        engine.grammars.compile(grammar).result()
        compile_ms[name] = (time.perf_counter() - start) * 1e3
        modes[name] = SamplingParams(max_new_tokens=args.output_len, temperature=0, grammar=grammar)
    timer = LoopTimer(engine)
    for params in modes.values():
        timer.run(engine, prompts, params)  # warm-up (kernels, the grammar's mask cache)
    steps: dict[str, list[float]] = {mode: [] for mode in modes}
    parts: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        for mode, params in modes.items():
            intervals, per_step = timer.run(engine, prompts, params)
            steps[mode] += intervals
            parts[mode].append(per_step)
    plain = statistics.median(steps["plain"])
    result = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "model": str(path),
        "batch_size": bs,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "vocab_size": engine.vocab_size,
        "plain_step_ms": plain,
        "steps_measured": len(steps["plain"]),
        "fill_threads": engine.grammars.threads,
        "gil_switch_ms": sys.getswitchinterval() * 1e3,
    }

    def breakdown(mode: str) -> dict[str, float]:
        keys = dict.fromkeys(key for p in parts[mode] for key in p)
        return {key: statistics.median(p[key] for p in parts[mode] if key in p) for key in keys}

    result["plain_parts_ms"] = breakdown("plain")
    print(
        f"\n{result['gpu']}: batch {bs}, vocab {engine.vocab_size}, {engine.grammars.threads} fill threads, "
        f"GIL switch {sys.getswitchinterval() * 1e3:g} ms: "
        f"loop step {plain:.3f} ms plain; per step {_show(result['plain_parts_ms'])}"
    )
    for name in SCHEMAS:
        step = statistics.median(steps[name])
        result[name] = {
            "compile_ms": compile_ms[name],
            "step_ms": step,
            "over_plain": step / plain,
            "parts_ms": breakdown(name),
        }
        print(
            f"  {name}: {step:.3f} ms ({step / plain:.3f}x plain); compiled in {compile_ms[name]:.1f} ms; "
            f"per step {_show(result[name]['parts_ms'])}"
        )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _show(parts: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms:.3f} ms" for name, ms in parts.items())


if __name__ == "__main__":
    main()
