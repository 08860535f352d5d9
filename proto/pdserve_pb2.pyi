from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "skip_special_tokens", "prompt_logprobs", "logit_bias", "grammar", "resumed_output_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    include_stop_str_in_output: bool
    logprobs: int
    skip_special_tokens: bool
    prompt_logprobs: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    grammar: Grammar
    resumed_output_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., resumed_output_tokens: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "bootstrap_room", "deadline_unix_s", "local_prefill", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    bootstrap_room: int
    deadline_unix_s: float
    local_prefill: bool
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., bootstrap_room: _Optional[int] = ..., deadline_unix_s: _Optional[float] = ..., local_prefill: _Optional[bool] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., rank: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    class Code(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CODE_UNSPECIFIED: _ClassVar[Error.Code]
        INVALID_REQUEST: _ClassVar[Error.Code]
        OVERLOADED: _ClassVar[Error.Code]
        KV_TRANSFER_TIMEOUT: _ClassVar[Error.Code]
        KV_TRANSFER_FAILED: _ClassVar[Error.Code]
        INTERNAL: _ClassVar[Error.Code]
        ABORTED: _ClassVar[Error.Code]
    CODE_UNSPECIFIED: Error.Code
    INVALID_REQUEST: Error.Code
    OVERLOADED: Error.Code
    KV_TRANSFER_TIMEOUT: Error.Code
    KV_TRANSFER_FAILED: Error.Code
    INTERNAL: Error.Code
    ABORTED: Error.Code
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: Error.Code
    message: str
    def __init__(self, code: _Optional[_Union[Error.Code, str]] = ..., message: _Optional[str] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("page_size", "num_layers", "kv_heads", "head_dim", "dtype", "num_pages")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    num_pages: int
    def __init__(self, page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., num_pages: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("bootstrap_room", "decode_agent_name", "decode_agent_metadata", "page_ids", "layout", "prefix_len", "expires_unix_s")
    BOOTSTRAP_ROOM_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DECODE_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    bootstrap_room: int
    decode_agent_name: str
    decode_agent_metadata: bytes
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    layout: KVLayout
    prefix_len: int
    expires_unix_s: float
    def __init__(self, bootstrap_room: _Optional[int] = ..., decode_agent_name: _Optional[str] = ..., decode_agent_metadata: _Optional[bytes] = ..., page_ids: _Optional[_Iterable[int]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., prefix_len: _Optional[int] = ..., expires_unix_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_used_tokens", "kv_total_tokens", "inflight_transfers")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_used_tokens: int
    kv_total_tokens: int
    inflight_transfers: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_total_tokens: _Optional[int] = ..., inflight_transfers: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("role", "model_path", "served_model_name", "architecture", "layout", "context_length", "max_running_requests", "max_total_tokens", "transfer_backend", "version")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROLE_UNSPECIFIED: _ClassVar[ServerInfo.Role]
        PREFILL: _ClassVar[ServerInfo.Role]
        DECODE: _ClassVar[ServerInfo.Role]
    ROLE_UNSPECIFIED: ServerInfo.Role
    PREFILL: ServerInfo.Role
    DECODE: ServerInfo.Role
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    role: ServerInfo.Role
    model_path: str
    served_model_name: str
    architecture: str
    layout: KVLayout
    context_length: int
    max_running_requests: int
    max_total_tokens: int
    transfer_backend: str
    version: str
    def __init__(self, role: _Optional[_Union[ServerInfo.Role, str]] = ..., model_path: _Optional[str] = ..., served_model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., context_length: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., max_total_tokens: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class GetAgentMetadataRequest(_message.Message):
    __slots__ = ("requester",)
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    requester: str
    def __init__(self, requester: _Optional[str] = ...) -> None: ...

class AgentMetadata(_message.Message):
    __slots__ = ("agent_name", "metadata", "layout")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    metadata: bytes
    layout: KVLayout
    def __init__(self, agent_name: _Optional[str] = ..., metadata: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class FinishInfo(_message.Message):
    __slots__ = ("reason", "token_id", "text", "usage", "timings")
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    token_id: int
    text: str
    usage: Usage
    timings: DecodeTimings
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[DecodeTimings, _Mapping]] = ...) -> None: ...

class DecodeTimings(_message.Message):
    __slots__ = ("queue_s", "kv_wait_s", "prefill_s", "slot_wait_s", "first_token_s", "decode_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    KV_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    SLOT_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    kv_wait_s: float
    prefill_s: float
    slot_wait_s: float
    first_token_s: float
    decode_s: float
    def __init__(self, queue_s: _Optional[float] = ..., kv_wait_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., slot_wait_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., decode_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("destination", "tokens", "finish", "error")
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    destination: KVDestination
    tokens: TokenChunk
    finish: FinishInfo
    error: Error
    def __init__(self, destination: _Optional[_Union[KVDestination, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finish: _Optional[_Union[FinishInfo, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("requests", "abort_request_ids")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    abort_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ..., abort_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "response")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: GenerateResponse
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class TokenColumns(_message.Message):
    __slots__ = ("request_ids", "indices", "counts", "token_ids")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    indices: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., indices: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("updates", "tokens")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    tokens: TokenColumns
    def __init__(self, updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., tokens: _Optional[_Union[TokenColumns, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "destination")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    destination: KVDestination
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "transfer_s", "transfer_bytes", "destination_wait_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    destination_wait_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., destination_wait_s: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "cached_tokens", "prompt_tokens", "timings", "error", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: TokenLogprob
    cached_tokens: int
    prompt_tokens: int
    timings: Timings
    error: Error
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
