"""`pdserve up`'s flags: the layout's, and those it passes to the router and the servers as given
(router/up.py runs the deployment). The model defaults to common/default_model.py's, with its
model card's sampling defaults.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys

from pdserve.common.config import EngineConfig
from pdserve.common.default_model import GGUF_NAME, INSTALL, MAX_TOKENS, SAMPLING, default_model_path
from pdserve.common.openai.defaults import FLAG_HELP
from pdserve.router.disagg import POLICIES
from pdserve.router.gpu_sharing import DEFAULT_SM_SHARES, MODES, MPSUnavailable
from pdserve.router.policies import POLICY_NAMES
from pdserve.router.up import LOG_LEVELS, Passthrough, ProcessExited, up

# Server flags `pdserve up` takes itself (the rest: --server-args).
SERVER_FLAGS = (
    "max_running_requests",
    "chunked_prefill_size",
    "kv_cache_dtype",
    "quantization",
    "speculative",
    "num_speculative_tokens",
    "draft_model_path",
)
ENGINE_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}


def add_parser(sub) -> None:
    """`pdserve up` on the `pdserve` command's sub-parsers (entry point group pdserve.commands)."""
    local = sub.add_parser("up", help="Start a local router + prefill + decode deployment (Ctrl-C stops it).")
    local.add_argument(
        "--model-path",
        default=None,
        help=f"Checkpoint directory or GGUF file; default: {GGUF_NAME} (installed by make setup: {INSTALL}), with "
        "its model card's sampling defaults.",
    )
    local.add_argument(
        "--tiny-model",
        action="store_true",
        help="Serve a tiny random-weight llama made on the fly instead (no download; its answers are noise).",
    )
    local.add_argument(
        "--num-prefill",
        type=int,
        default=None,
        help="Prefill servers to start (0: decode servers prefill every request); default: 1, but on GPUs the "
        "layout that served the most there, printed at start (docs/disaggregation.md).",
    )
    local.add_argument(
        "--num-decode",
        type=int,
        default=None,
        help="Decode servers to start; default: 1, but on two or more GPUs a prefill and a decode server on each "
        "GPU (with --num-prefill not given), printed at start (docs/disaggregation.md).",
    )
    local.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when a GPU is visible).")
    local.add_argument(
        "--gpus",
        default=None,
        metavar="0,1,...",
        help="GPUs to place the servers on, numbered as this process sees them; default: every visible "
        "one. Each server gets as many as its TP size, its own while they last, then shared.",
    )
    local.add_argument("--prefill-tp", type=int, default=1, help="--tp-size of each prefill server (a GPU per rank).")
    local.add_argument("--decode-tp", type=int, default=1, help="--tp-size of each decode server (a GPU per rank).")
    local.add_argument("--host", default="127.0.0.1", help="Router HTTP address.")
    local.add_argument("--port", type=int, default=8000, help="Router HTTP port.")
    local.add_argument(
        "--prefill-policy",
        default="round_robin",
        choices=POLICY_NAMES,
        help="How the router picks a prefill server (cache_aware, prefix_hash: by prompt prefix).",
    )
    local.add_argument(
        "--decode-policy", default="round_robin", choices=POLICY_NAMES, help="How the router picks a decode server."
    )
    local.add_argument(
        "--disagg-policy",
        default=None,
        choices=POLICIES,
        help="always: prefill servers prefill every request; never: decode servers do (colocated "
        "replicas; with --num-prefill 0); auto: decode servers take short prompts (pdserve-router "
        "--help). Default: never with no prefill server, else always.",
    )
    local.add_argument(
        "--mps",
        default="auto",
        choices=MODES,
        help="Servers sharing a GPU run under a private NVIDIA MPS daemon, side by side instead of "
        "time-sliced. auto: where MPS can be had (else a warning, and the one-GPU default layout "
        "turns colocated); on: MPS or an error; off: never.",
    )
    local.add_argument(
        "--sm-shares",
        default="auto",
        metavar="PREFILL:DECODE",
        help="Under MPS, the percent of a shared GPU's SMs each role's servers may occupy "
        f"(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); auto: {DEFAULT_SM_SHARES} (measured: docs/disaggregation.md).",
    )
    local.add_argument(
        "--router-workers",
        type=int,
        default=0,
        help="The router's --workers: its processes; 0: from the CPU cores (see pdserve-router --help).",
    )
    passed = local.add_argument_group(
        "passed to the router and servers", "As pdserve-router and prefill-server/decode-server take them."
    )
    passed.add_argument(
        "--log-level", default="info", choices=LOG_LEVELS, help="Every process's; info logs each request."
    )
    passed.add_argument("--served-model-name", default="", help="Model name clients use; default: the file's or "
                        "directory's short name.")  # fmt: skip
    passed.add_argument("--api-key", default="", help="Require 'Authorization: Bearer KEY' on the API.")
    passed.add_argument(
        "--otlp-traces-endpoint",
        default="",
        metavar="URL",
        help='Trace every process to this OTLP/gRPC collector (docs/deploy/observe.md, "Tracing"); default: '
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing.",
    )
    passed.add_argument("--dtype", default="auto", help="Weights' and KV's dtype on the servers.")
    passed.add_argument("--context-length", type=int, default=0, help="Longest sequence; 0: the model's.")
    for flag, default in (("generation_config", "auto"), ("override_generation_config", ""), ("default_max_tokens", 0)):
        passed.add_argument("--" + flag.replace("_", "-"), type=type(default), default=default, help=FLAG_HELP[flag])
    servers = local.add_argument_group(
        "passed to the prefill and decode servers",
        "Their flags users reach for most, as prefill-server and decode-server take them (defaults: theirs); "
        "any other through --server-args.",
    )
    for name in SERVER_FLAGS:
        f = ENGINE_FIELDS[name]
        # (None: not given, so the servers' own default holds)
        servers.add_argument("--" + name.replace("_", "-"), type=type(f.default), default=None, help=f.metadata["help"])
    passed.add_argument(
        "--router-args", default="", metavar="'FLAGS'", help="More pdserve-router flags, as one string."
    )
    passed.add_argument(
        "--server-args",
        default="",
        metavar="'FLAGS'",
        help="More prefill-server and decode-server flags, as one string (not those above: a flag given both ways "
        "is an error).",
    )
    local.set_defaults(func=_up)


def passthrough_of(args) -> tuple[str | None, Passthrough]:
    """The model to serve (None: the tiny one) and what goes to the processes, from `pdserve up`'s
    flags. ValueError for flags that contradict each other."""
    if args.tiny_model and args.model_path:
        raise ValueError("--tiny-model and --model-path: give one")
    model_path, override = args.model_path, args.override_generation_config
    if model_path is None and not args.tiny_model:
        try:
            model_path = default_model_path()
        except FileNotFoundError as e:
            raise ValueError(f"{e}; or give --model-path, or --tiny-model") from None
        if args.generation_config == "auto" and not override:
            override = json.dumps(SAMPLING)  # its model card's: the GGUF carries none
        max_tokens = args.default_max_tokens or MAX_TOKENS
        print(f"model: {GGUF_NAME} (the default); sampling defaults: {override or 'as asked'}, max_tokens {max_tokens}")
    else:
        max_tokens = args.default_max_tokens
    router = ["--generation-config", args.generation_config, "--default-max-tokens", str(max_tokens)]
    router += ["--override-generation-config", override] if override else []
    both = ["--context-length", str(args.context_length)]
    both += ["--served-model-name", args.served_model_name] if args.served_model_name else []
    both += ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []
    router += ["--api-key", args.api_key] if args.api_key else []
    given = [(name, getattr(args, name)) for name in SERVER_FLAGS if getattr(args, name) is not None]
    both_servers = [item for name, value in given for item in ("--" + name.replace("_", "-"), str(value))]
    try:
        extra_router, extra_servers = shlex.split(args.router_args), shlex.split(args.server_args)
    except ValueError as e:
        raise ValueError(f"--router-args / --server-args: {e}") from None
    extra_flags = {arg.split("=", 1)[0] for arg in extra_servers}  # (--flag=value gives --flag too)
    twice = ["--" + name.replace("_", "-") for name, _ in given if "--" + name.replace("_", "-") in extra_flags]
    if twice:
        raise ValueError(f"{', '.join(twice)} given both as pdserve up's own flag and in --server-args: give it once")
    return model_path, Passthrough(
        log_level=args.log_level,
        router=(*router, *both, *extra_router),
        servers=("--dtype", args.dtype, *both, *both_servers, *extra_servers),
        served_model_name=args.served_model_name,
        api_key=args.api_key,
    )


def _up(args) -> int:
    try:
        model_path, passthrough = passthrough_of(args)
        return up(
            model_path,
            args.num_prefill,
            args.num_decode,
            args.device,
            args.port,
            args.host,
            args.prefill_policy,
            args.decode_policy,
            args.router_workers,
            args.gpus,
            args.prefill_tp,
            args.decode_tp,
            args.disagg_policy,
            args.mps,
            args.sm_shares,
            passthrough,
        )
    except ValueError as e:  # bad flags (placement, device): up() checks them before it starts anything
        print(f"error: {e}", file=sys.stderr)
        return 2
    except MPSUnavailable as e:  # --mps on
        print(f"error: --mps on, but MPS cannot be had: {e}", file=sys.stderr)
        return 1
    except (ProcessExited, TimeoutError) as e:  # everything it started is stopped by now
        print(f"error: {e}", file=sys.stderr)
        return 1
