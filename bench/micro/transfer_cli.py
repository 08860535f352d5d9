"""`pdserve bench transfer`'s flags (the benchmark itself is bench/micro/transfer.py, imported only when it runs)."""

from __future__ import annotations

from pdserve.common.list_flag import ListFlag

TRANSFER_DOC = """KV transfer micro-benchmark: N requests x L tokens of KV written from a pool in one
process into a pool in another (bench/micro/transfer.py), through each path (direct: a device copy through CUDA
IPC; nixl: NIXL WRITEs). Per request: the sending thread's host time, the operations posted, the latency
to the receiver's notification; GB/s over the run. Every destination page is checked against its source."""


def add_transfer_parser(kinds):
    """The `transfer` sub-command on `pdserve bench`'s sub-parsers; its func is the caller's to set."""
    transfer = kinds.add_parser(
        "transfer",
        help="KV transfer between two pools in two processes: per-request host time, descriptors, latency, GB/s.",
        description=TRANSFER_DOC,
    )
    transfer.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: DRAM pools; cuda: VRAM.")
    transfer.add_argument("--shape", default="gpt2/small", help="The model shape whose KV moves (bench/shapes.py).")
    transfer.add_argument("--dtype", default="", help="KV dtype; default: bfloat16 on CUDA, float32 on the CPU.")
    transfer.add_argument("--requests", type=int, default=32, help="Requests (the burst phase posts them all at once).")
    transfer.add_argument("--tokens", type=int, default=256, help="Tokens of KV per request.")
    transfer.add_argument("--page-size", type=int, default=16)
    transfer.add_argument("--fragment", action="store_true", help="Hand pages out shuffled: short page runs.")
    transfer.add_argument(
        "--paths",
        nargs="+",
        action=ListFlag,
        choices=("auto", "direct", "nixl"),
        help="Default: direct and nixl on CUDA, nixl on CPU.",
    )
    transfer.add_argument("--sender-gpu", type=int, default=0, help="CUDA: the sending pool's GPU.")
    transfer.add_argument("--receiver-gpu", type=int, default=0, help="CUDA: the receiving pool's GPU.")
    transfer.add_argument(
        "--time-calls",
        action="store_true",
        help="Time the calls inside each WRITE on the sending thread (checks, NIXL's calls, the copy's launch).",
    )
    transfer.add_argument("--output-json", default="", help="Write the results here too.")
    return transfer
