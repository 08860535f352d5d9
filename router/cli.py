"""`pdserve-router`: the OpenAI-compatible HTTP front door (see `pdserve-router --help`)."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-router", description="OpenAI-compatible router pairing prefill and decode servers.")
    p.add_argument("--model-path", required=True, help="Checkpoint directory: the tokenizer, chat template and limits come from it.")
    p.add_argument("--prefill", nargs="+", default=[], metavar="HOST:PORT", help="Prefill servers (gRPC).")
    p.add_argument("--decode", nargs="+", default=[], metavar="HOST:PORT", help="Decode servers (gRPC).")
    p.add_argument("--prefill-dns", nargs="+", default=[], metavar="NAME:PORT",
                   help="Discover prefill servers: NAME (e.g. a headless Service) is resolved every 2 s; "
                        "addresses are added (once healthy) and removed as they come and go.")
    p.add_argument("--decode-dns", nargs="+", default=[], metavar="NAME:PORT", help="Discover decode servers, likewise.")
    p.add_argument("--served-model-name", default="", help="Model name clients use; default: --model-path as given.")
    p.add_argument("--api-key", default="", help="Require 'Authorization: Bearer KEY' on the API.")
    p.add_argument("--prefill-policy", default="round_robin", help="round_robin, least_load or cache_aware.")
    p.add_argument("--decode-policy", default="round_robin", help="round_robin or least_load.")
    p.add_argument("--max-inflight", type=int, default=1024, help="Requests in flight before new ones get 429 + Retry-After.")
    p.add_argument("--request-timeout", type=float, default=600.0, help="Seconds a request may take (its deadline on both servers).")
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address.")
    p.add_argument("--port", type=int, default=8000, help="HTTP port.")
    p.add_argument("--log-level", default="info", help="Logging level.")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.prefill or args.prefill_dns) or not (args.decode or args.decode_dns):
        parser.error("give prefill servers (--prefill or --prefill-dns) and decode servers (--decode or --decode-dns)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s router: %(message)s")
    import uvicorn

    from pdserve.router.app import Router, RouterConfig, create_app

    config = RouterConfig(args.model_path, tuple(args.prefill), tuple(args.decode), args.served_model_name, args.api_key,
                          args.prefill_policy, args.decode_policy, args.max_inflight, args.request_timeout,
                          tuple(args.prefill_dns), tuple(args.decode_dns))
    try:
        router = Router(config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(router), host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


if __name__ == "__main__":
    sys.exit(main())
