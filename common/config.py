"""Engine configuration: one frozen dataclass, its CLI flags generated from the fields.

"auto" values are resolved once (`resolve`) against the model and the device before the engine
starts, so nothing downstream ever sees an unresolved value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.common import gguf_checkpoint
from pdserve.common.list_flag import ListFlag
from pdserve.common.model_checks import check_model_path, check_tp, resolve_kv_cache_dtype, resolve_quantization
from pdserve.common.speculation import SPECULATIVE_MAX_BATCH, check_speculative

# What CUDA graphs, activations and the sampling buffers get is the rest of the GPU's memory.
DEFAULT_MEM_FRACTION_STATIC = 0.85
# Tokens per streamed chunk on CUDA unless --stream-interval says: at a 2-3 ms decode step and
# hundreds of streams, one chunk per token is more than the router and the clients can move (an H100
# host, GPT-2 shape, 1024 streams: 0.61x the offline engine at 1, 0.80x at 4; docs/benchmarks/README.md).
# A 4-token chunk is ~10 ms of a stream there; on CPU a step is tens of ms, so there every token goes.
DEFAULT_CUDA_STREAM_INTERVAL = 4


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field whose `--flag` add_cli_args generates: its default, its help, and any extra
    argparse keywords (metavar, required)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the colocated engine needs to start. Flags are `--field-name`."""

    model_path: str = option(
        "",
        "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), or a GGUF file (or a "
        "directory holding one), dequantized at load.",
    )
    served_model_name: str = option(
        "",
        "Model name clients use; default: the checkpoint's short name (its directory's, or its file's "
        "without .gguf). --model-path as given is accepted too.",
    )
    device: str = option("auto", "cpu, cuda or cuda:N; auto picks cuda when available.")
    dtype: str = option("auto", "float32, float16 or bfloat16; auto: float32 on CPU, bfloat16 on CUDA.")
    page_size: int = option(16, "Tokens per KV page.")
    context_length: int = option(0, "Longest sequence (prompt + output); 0: the model's max_position_embeddings.")
    max_total_tokens: int = option(0, "KV cache capacity in tokens; 0: sized from --kv-cache-memory-gb.")
    kv_cache_memory_gb: float = option(
        0.0, "GiB for the KV cache when --max-total-tokens is 0; 0: from --mem-fraction-static on CUDA, 1 GiB on CPU."
    )
    mem_fraction_static: float = option(
        0.0,
        "CUDA: fraction of the GPU's memory for weights + KV cache; the KV cache gets what is left of it "
        f"after loading the model, measured (SGLang's meaning). 0: {DEFAULT_MEM_FRACTION_STATIC} on CUDA "
        "unless --kv-cache-memory-gb or --max-total-tokens is given.",
    )
    max_running_requests: int = option(256, "Most requests in the running batch at once.")
    max_prefill_tokens: int = option(16384, "Most prompt tokens in one prefill batch.")
    chunked_prefill_size: int = option(
        8192, "Prompts longer than this are prefilled in chunks of this many tokens; <= 0 disables chunking."
    )
    num_reserved_decode_tokens: int = option(
        512, "KV tokens admission keeps free per running request for its next decode steps."
    )
    schedule_policy: str = option("fcfs", "Order of the waiting queue: fcfs, or lpm (longest cached prefix first).")
    disable_radix_cache: bool = option(False, "Turn off prefix caching (the radix tree over the KV pages).")
    host_kv_cache_gb: float = option(
        0.0,
        "GiB of host memory (pinned on a GPU) that pages evicted from the prefix cache are kept in and "
        "copied back from on a hit; 0: evicted pages are dropped. With --tp-size N, per rank (each keeps its heads).",
    )
    host_kv_write_policy: str = option(
        "write_through",
        "When the host tier copies a page: write_through backs it up as soon as it is cached, on a side "
        "stream, so evicting it copies nothing; write_back copies it when evicted, ahead of the next forward.",
        choices=("write_through", "write_back"),
    )
    disable_prefix_aware_transfers: bool = option(
        False,
        "Decode: receive a prompt's whole KV from the prefill server even where this server's prefix cache "
        "holds its beginning (by default only the pages it lacks cross).",
    )
    disable_overlap_schedule: bool = option(False, "Run the plain serial loop instead of the overlapped one.")
    serial_consecutive_prefill: bool = option(
        False, "Process a prefill's result before launching the next prefill (lower TTFT under load)."
    )
    attention_backend: str = option(
        "auto", "torch_native (the reference; CPU and CUDA) or triton (paged kernels; CUDA); auto: triton on CUDA."
    )
    disable_cuda_graph: bool = option(
        False, "CUDA: run decode and prefill eagerly instead of replaying captured CUDA graphs."
    )
    cuda_graph_max_bs: int = option(
        0,
        "CUDA: largest decode batch captured in a graph (padded up to the next captured size); "
        "0: --max-running-requests, at most 256.",
    )
    prefill_cuda_graph_max_tokens: int = option(
        2048,
        "CUDA: prefill batches of at most this many tokens (and 16 requests) replay a captured graph, padded "
        "up to the next captured token count (at most a quarter more); 0 runs every prefill eagerly.",
    )
    stream_interval: int = option(
        0,
        "A streamed request's new tokens are sent every this many tokens (its first and its last at once); "
        "larger values cost the servers, the router and the clients less per token under load "
        f"(SGLang's --stream-interval). 0: {DEFAULT_CUDA_STREAM_INTERVAL} on CUDA, 1 on CPU.",
    )
    random_seed: int = option(-1, "Seed for the per-request seeds the engine draws; -1: from the OS.")
    tp_size: int = option(
        1,
        "Tensor-parallel ranks: one process per rank, each holding 1/N of the weights and of the KV heads "
        "(on CUDA one GPU each: rank r on cuda:r, counted from --device's index).",
    )
    dist_timeout: float = option(
        120.0,
        "Tensor parallelism: seconds a rank waits for the others (start-up, any collective) before it "
        "gives up; a rank that dies is noticed at once.",
    )
    tp_all_reduce: str = option(
        "nccl",
        "Tensor parallelism on CUDA: nccl, or symm (experimental): the decode step's all-reduces (up to the "
        "largest CUDA-graph batch) by torch's symmetric-memory two-shot kernel over NVLink, the rest by NCCL; "
        "falls back to NCCL, with a warning, where symmetric memory cannot be set up.",
        choices=("nccl", "symm"),
    )
    quantization: str = option(
        "",
        "fp8: quantize the linear layers of the transformer blocks to float8 e4m3 at load (a scale per output "
        "channel; activations scaled per token); fp8-block: a scale per 128 x 128 block of the weight, "
        "activations scaled per token and group of 128. The LM head and embeddings stay in --dtype. Empty: the "
        "checkpoint's own weights. An FP8 checkpoint (compressed-tensors, or quant_method fp8; per-tensor, "
        "per-channel or block-wise) is served in its own FP8 form whatever this flag says. "
        "fp8-block (and block-wise checkpoints) need --tp-size 1.",
    )
    fp8_lm_head: bool = option(
        False,
        "Compute the logits from a float8 e4m3 copy of the LM head (a scale per vocabulary row, activations scaled "
        "per token), with or without --quantization: less to read a step, at some accuracy (docs/features/fp8.md). "
        "A head tied to the embeddings keeps them in --dtype beside the copy.",
    )
    kv_cache_dtype: str = option(
        "auto",
        "fp8_e4m3: K and V stored as float8 e4m3, one scale per layer for K and for V (the checkpoint's "
        "k_scale/v_scale, else calibrated at start-up): ~2x the tokens at the same memory. auto: --dtype.",
    )
    speculative: str = option(
        "",
        "ngram: speculative decode steps, drafts copied from the request's own prompt and output (prompt "
        "lookup); draft: drafts from a small model (--draft-model-path); verified exactly (the tokens are the "
        "plain engine's, seed for seed); empty: off.",
    )
    num_speculative_tokens: int = option(4, "--speculative: most drafts per request in one verify step.")
    draft_model_path: str = option("", "--speculative draft: the draft model's checkpoint (the target's vocabulary).")
    speculative_ngram_min: int = option(1, "--speculative ngram: the shortest suffix looked up.")
    speculative_ngram_max: int = option(4, "--speculative ngram: the longest suffix looked up.")
    speculative_max_batch: int = option(
        SPECULATIVE_MAX_BATCH, "--speculative: decode steps of more requests than this run plain; 0: no limit."
    )
    speculative_fixed_k: bool = option(
        False, "--speculative: never offer a request fewer drafts because its recent ones were mostly rejected."
    )
    speculative_overlap: str = option(
        "auto",
        "--speculative: schedule a verify step while the previous one runs, its drafts guessing how that "
        "one ends: on, off, or auto (while recent guesses would mostly hold).",
    )

    def resolve(self) -> "EngineConfig":
        """Fill every auto value; the result is what the engine runs with."""
        if not self.model_path:
            raise ValueError("--model-path is required")
        check_model_path(self.model_path)
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        if dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"--dtype must be float32, float16 or bfloat16, got {dtype!r}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        hf = read_hf_config(self.model_path)
        model_max = int(hf.get("max_position_embeddings") or hf.get("n_positions") or 2048)
        context_length = self.context_length or model_max
        if context_length > model_max:
            raise ValueError(f"--context-length {context_length} exceeds the model's {model_max}")
        for name in ("max_running_requests", "max_prefill_tokens", "num_reserved_decode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0.0 <= self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in [0, 1), got {self.mem_fraction_static}")
        if self.mem_fraction_static and not device.startswith("cuda"):
            raise ValueError(
                "--mem-fraction-static sizes GPU memory; on CPU use --max-total-tokens or --kv-cache-memory-gb"
            )
        if self.stream_interval < 0:
            raise ValueError(f"--stream-interval must be >= 0, got {self.stream_interval}")
        stream_interval = self.stream_interval or (DEFAULT_CUDA_STREAM_INTERVAL if device.startswith("cuda") else 1)
        if self.kv_cache_memory_gb < 0:
            raise ValueError(f"--kv-cache-memory-gb must be >= 0, got {self.kv_cache_memory_gb}")
        if self.host_kv_cache_gb < 0:
            raise ValueError(f"--host-kv-cache-gb must be >= 0, got {self.host_kv_cache_gb}")
        if self.host_kv_cache_gb and self.disable_radix_cache:
            raise ValueError("--host-kv-cache-gb needs the prefix cache (it holds the cache's evicted pages)")
        mem_fraction_static, kv_cache_memory_gb = self.mem_fraction_static, self.kv_cache_memory_gb
        if not (self.max_total_tokens or kv_cache_memory_gb or mem_fraction_static):
            if device.startswith("cuda"):
                mem_fraction_static = DEFAULT_MEM_FRACTION_STATIC
            else:
                kv_cache_memory_gb = 1.0
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")
        attention_backend = self.attention_backend
        if attention_backend == "auto":
            attention_backend = "triton" if device.startswith("cuda") else "torch_native"
        if attention_backend not in ("torch_native", "triton"):
            raise ValueError(f"--attention-backend must be torch_native, triton or auto, got {attention_backend!r}")
        if (
            attention_backend == "triton"
            and not device.startswith("cuda")
            and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            # On CPU the kernels run only in Triton's interpreter (slow; the CPU tests use it).
            raise ValueError(
                "--attention-backend triton needs a CUDA device (or TRITON_INTERPRET=1); on CPU use torch_native"
            )
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"--cuda-graph-max-bs must be >= 0, got {self.cuda_graph_max_bs}")
        if self.prefill_cuda_graph_max_tokens < 0:
            raise ValueError(f"--prefill-cuda-graph-max-tokens must be >= 0, got {self.prefill_cuda_graph_max_tokens}")
        check_tp(self.tp_size, self.dist_timeout, hf, device)
        quantization = resolve_quantization(self.quantization, hf, self.model_path, self.tp_size)
        kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype, dtype)
        check_speculative(self, read_hf_config)
        return dataclasses.replace(
            self,
            attention_backend=attention_backend,
            mem_fraction_static=mem_fraction_static,
            kv_cache_memory_gb=kv_cache_memory_gb,
            served_model_name=self.served_model_name or short_model_name(self.model_path),
            device=device,
            dtype=dtype,
            context_length=context_length,
            stream_interval=stream_interval,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
        )


def short_model_name(model_path: str) -> str:
    """The name a model is served under unless --served-model-name says otherwise: its directory's
    name, or its file's without .gguf (`--model-path` as given is accepted too: an alias)."""
    name = os.path.basename(os.path.abspath(model_path))
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def read_hf_config(model_path: str) -> dict:
    """config.json's fields; for a GGUF checkpoint the same fields from its metadata."""
    gguf = gguf_checkpoint.gguf_file(model_path)
    if gguf is not None:
        return gguf_checkpoint.hf_config(gguf)
    with open(os.path.join(model_path, "config.json")) as f:
        return json.load(f)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names each option's default after its help: "(default: 16)". Not for a default that
    says nothing (None, False, an empty string or tuple), where the help text says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default is argparse.SUPPRESS:
            return help
        if "%(default)" in help or (isinstance(default, (str, tuple, list)) and not default):
            return help
        shown = " ".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)
        return f"{help} (default: {shown.replace('%', '%%')})"  # NOTE: argparse %-formats help text


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Give `parser` and its sub-commands' parsers the DefaultsHelpFormatter (sub-parsers don't inherit it)."""
    if not issubclass(parser.formatter_class, DefaultsHelpFormatter):  # a subclass stays (bench/cli.py's)
        parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                show_defaults(sub)
    return parser


def add_cli_args(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    """One `--flag` per dataclass field, typed and documented from the field itself, in the order
    of the constructor (keyword-only fields, such as an inherited TrustConfig's, last).

    A tuple field takes strings, adding up when repeated (ListFlag); other metadata goes to argparse."""
    for f in sorted(dataclasses.fields(cls), key=lambda f: f.kw_only):
        flag = "--" + f.name.replace("_", "-")
        kw = {k: v for k, v in f.metadata.items() if k != "help"}
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action="store_true", help=f.metadata["help"], **kw)
        elif isinstance(f.default, tuple):
            kw = {"nargs": "+", "action": ListFlag} | kw
            parser.add_argument(flag, dest=f.name, type=str, default=f.default, help=f.metadata["help"], **kw)
        else:
            parser.add_argument(
                flag, dest=f.name, type=type(f.default), default=f.default, help=f.metadata["help"], **kw
            )


def from_cli_args(args: argparse.Namespace, cls: type = EngineConfig) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
