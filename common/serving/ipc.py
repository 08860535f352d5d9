"""Typed messages between a server's frontend process and its scheduler process, over pyzmq.

Two one-way ipc:// channels (PUSH -> PULL), one each way, carrying msgspec msgpack-encoded,
tagged structs: no pickle. NOTE: a PUSH socket closed with pending messages can drop them, so
every socket here lingers (bounded) on close, and the scheduler's last message before exiting
(`Bye`) is only sent once the frontend has asked it to stop.
"""

from __future__ import annotations

import msgspec

from pdserve.common.errors import ErrorCode
from pdserve.common.types import SamplingParams

# ---- frontend -> scheduler --------------------------------------------------------------------


class Params(msgspec.Struct, frozen=True):
    """SamplingParams' fields, as plain data (validated into SamplingParams by the scheduler)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: tuple[str, str] | None = None
    resumed_output_tokens: int = 0


def sampling_params(p: Params) -> SamplingParams:
    """Validated SamplingParams (ValueError with a message for the client)."""
    fields = {f: getattr(p, f) for f in p.__struct_fields__}
    fields["logit_bias"] = tuple(tuple(pair) for pair in p.logit_bias)  # msgpack gives lists
    fields["grammar"] = tuple(p.grammar) if p.grammar is not None else None
    return SamplingParams(**fields)


class NewRequest(msgspec.Struct, tag=True):
    """A request for this server. Prefill requests also carry their KV destination, or none
    (empty peer_metadata) when it follows in a SetDestination."""

    rid: str
    prompt_ids: list[int]
    params: Params
    room: int
    peer_metadata: bytes = b""
    page_ids: list[int] = []
    expires_unix_s: float = 0.0  # the destination's expiry; 0: none
    prefix_len: int = 0  # the destination's (its pages start there)
    local: bool = False  # a decode server prefills it itself (GenerateRequest.local_prefill)


class SetDestination(msgspec.Struct, tag=True):
    """The KV destination of a prefill request that arrived without one."""

    rid: str
    peer_metadata: bytes
    page_ids: list[int]
    expires_unix_s: float = 0.0
    prefix_len: int = 0


class Abort(msgspec.Struct, tag=True):
    rid: str


class Drain(msgspec.Struct, tag=True):
    """Admit nothing new, finish what is in flight, then say Bye and exit."""


# ---- scheduler -> frontend --------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    """The scheduler is up: what GetServerInfo and GetAgentMetadata answer."""

    agent_name: str
    agent_metadata: bytes
    layout: dict
    info: dict


class Rejected(msgspec.Struct, tag=True):
    """The request could not be admitted (bad input, or draining); nothing was queued."""

    rid: str
    message: str
    code: ErrorCode = ErrorCode.INVALID_REQUEST


class Destination(msgspec.Struct, tag=True):
    """Decode: pages for the request's prompt are held; the prefill server may WRITE them
    until `expires_unix_s` (see KVDestination in the proto)."""

    rid: str
    room: int
    page_ids: list[int]  # for the prompt's positions from prefix_len on
    expires_unix_s: float
    prefix_len: int = 0


class Tokens(msgspec.Struct, tag=True):
    """Decode: new output tokens of a request, starting at output index `index`."""

    rid: str
    index: int
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []


class StepTokens(msgspec.Struct, tag=True):
    """Decode: every request's new tokens from one loop step, in one message (one send and one
    decode per step, however many requests are running)."""

    chunks: list[Tokens]


class DecodeTimings(msgspec.Struct, frozen=True):
    """Decode: where a finished request's time went here, in seconds (proto DecodeTimings says each)."""

    queue_s: float = 0.0
    kv_wait_s: float = 0.0
    prefill_s: float = 0.0
    slot_wait_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0
    local_prefill: bool = False  # prefilled here: no kv_wait_s or slot_wait_s, a prefill_s
    steps: int = 0  # forward steps that gave it tokens here (spans' attributes)
    spec_proposed: int = 0  # speculative drafts verified for it, and those accepted
    spec_accepted: int = 0


class Finished(msgspec.Struct, tag=True):
    """Decode: the request is over (its last Tokens were sent before this)."""

    rid: str
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    matched_token: int | None = None
    matched_text: str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    timings: DecodeTimings | None = None  # (None with an error)


class PrefillDone(msgspec.Struct, tag=True):
    """Prefill: the KV and the first token are at the decode server (or `error` says why not)."""

    rid: str
    first_token: int | None
    first_logprob: tuple[int, float, list[tuple[int, float]]] | None
    prompt_tokens: int
    cached_tokens: int
    queue_s: float  # from its arrival to its first prefill batch
    prefill_s: float  # from its first prefill batch to its first token
    transfer_s: float
    transfer_bytes: int
    destination_wait_s: float = 0.0  # from its first token to its transfer's start (its destination came late)
    transfer_pages: int = 0  # KV pages written to the decode server
    prefill_chunks: int = 0  # prefill batches its prompt was computed in (spans' attributes)
    chunk_s: tuple[float, ...] = ()  # each batch's share of prefill_s (a span each when there are several)
    transfer_path: str = ""  # "nixl" or "device_copy" (spans' attributes)
    error: str | None = None
    error_code: ErrorCode | None = None
    # Asked for: prompt tokens 1..n-1's (token id, logprob, top n, rank), in order.
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]], int]] | None = None


class LoadReport(msgspec.Struct, tag=True):
    running: int
    waiting: int
    kv_used_tokens: int
    kv_total_tokens: int
    inflight_transfers: int
    # The host KV tier's totals since start (KVManager.host_tier_report; empty without one).
    host_tier: dict[str, float] = msgspec.field(default_factory=dict)
    # Speculative decoding's counters since start, under the proposer's name (Speculation.report; empty: off).
    speculation: dict[str, dict[str, int]] = msgspec.field(default_factory=dict)


# Why a decode server refused a KV transfer notification (the label of pdserve_kv_rejected_transfers_total):
REJECT_REASONS = (
    "unknown_room",  # no destination with that room was granted (or it was freed long ago)
    "page_count",  # the notification's page count is not the granted one
    "byte_count",  # nor its byte count
    "head_range",  # KV heads the receiving TP rank does not hold
    "malformed",  # not a notification of this version, or a first token outside the vocabulary
    "checksum",  # --kv-integrity-check: the pages landed are not the sender's (the request fails, is moved)
)


class TransfersRejected(msgspec.Struct, tag=True):
    """Decode: notifications refused since the last such message, by reason (REJECT_REASONS)."""

    counts: dict[str, int]


class Bye(msgspec.Struct, tag=True):
    """The scheduler drained and is exiting."""


ToScheduler = NewRequest | SetDestination | Abort | Drain
ToFrontend = (
    Ready | Rejected | Destination | Tokens | StepTokens | Finished | PrefillDone | LoadReport | TransfersRejected | Bye
)

_to_scheduler = msgspec.msgpack.Decoder(ToScheduler)
_to_frontend = msgspec.msgpack.Decoder(ToFrontend)
_encoder = msgspec.msgpack.Encoder()

LINGER_MS = 2000


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decode_to_scheduler(data: bytes) -> ToScheduler:
    return _to_scheduler.decode(data)


def decode_to_frontend(data: bytes) -> ToFrontend:
    return _to_frontend.decode(data)


def ipc_paths(run_dir: str) -> tuple[str, str]:
    """(frontend -> scheduler, scheduler -> frontend) endpoints inside a private directory."""
    return f"ipc://{run_dir}/to-scheduler", f"ipc://{run_dir}/to-frontend"
