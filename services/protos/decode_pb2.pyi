from . import common_pb2 as _common_pb2
from . import kv_pb2 as _kv_pb2
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
    FINISH_REASON_PREEMPTED: _ClassVar[FinishReason]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_PREEMPTED: FinishReason
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "max_new_tokens", "num_forks", "prompt_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    max_new_tokens: int
    num_forks: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., num_forks: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ReservationRef(_message.Message):
    __slots__ = ("reservation_id", "fork")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    fork: int
    def __init__(self, reservation_id: _Optional[str] = ..., fork: _Optional[int] = ...) -> None: ...

class BeginWriteResponse(_message.Message):
    __slots__ = ("lease_s",)
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    lease_s: float
    def __init__(self, lease_s: _Optional[float] = ...) -> None: ...

class EndWriteResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("reservation_id", "prompt_ids", "sampling", "seed", "first_token", "fork", "output_ids")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Sampling
    seed: int
    first_token: int
    fork: int
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reservation_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., seed: _Optional[int] = ..., first_token: _Optional[int] = ..., fork: _Optional[int] = ..., output_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "done", "error")
    class Token(_message.Message):
        __slots__ = ("id", "index", "logprob")
        ID_FIELD_NUMBER: _ClassVar[int]
        INDEX_FIELD_NUMBER: _ClassVar[int]
        LOGPROB_FIELD_NUMBER: _ClassVar[int]
        id: int
        index: int
        logprob: _common_pb2.TokenLogprob
        def __init__(self, id: _Optional[int] = ..., index: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...
    class Done(_message.Message):
        __slots__ = ("finish_reason", "num_tokens")
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
        finish_reason: FinishReason
        num_tokens: int
        def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...
    class Error(_message.Message):
        __slots__ = ("code", "message")
        CODE_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        code: ErrorCode
        message: str
        def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    token: GenerateEvent.Token
    done: GenerateEvent.Done
    error: GenerateEvent.Error
    def __init__(self, token: _Optional[_Union[GenerateEvent.Token, _Mapping]] = ..., done: _Optional[_Union[GenerateEvent.Done, _Mapping]] = ..., error: _Optional[_Union[GenerateEvent.Error, _Mapping]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: bool
    def __init__(self, freed: _Optional[bool] = ...) -> None: ...

class DecodeStatus(_message.Message):
    __slots__ = ("model", "dcp", "rows_used", "rows_free", "rows_total", "rows_filled", "running", "reservations", "queue_depth", "serving", "rows_cached", "prefix_cache_queries", "prefix_cache_hits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DCP_FIELD_NUMBER: _ClassVar[int]
    ROWS_USED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FREE_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FILLED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ROWS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dcp: int
    rows_used: _containers.RepeatedScalarFieldContainer[int]
    rows_free: _containers.RepeatedScalarFieldContainer[int]
    rows_total: _containers.RepeatedScalarFieldContainer[int]
    rows_filled: _containers.RepeatedScalarFieldContainer[int]
    running: int
    reservations: int
    queue_depth: int
    serving: bool
    rows_cached: _containers.RepeatedScalarFieldContainer[int]
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, model: _Optional[str] = ..., dcp: _Optional[int] = ..., rows_used: _Optional[_Iterable[int]] = ..., rows_free: _Optional[_Iterable[int]] = ..., rows_total: _Optional[_Iterable[int]] = ..., rows_filled: _Optional[_Iterable[int]] = ..., running: _Optional[int] = ..., reservations: _Optional[int] = ..., queue_depth: _Optional[int] = ..., serving: _Optional[bool] = ..., rows_cached: _Optional[_Iterable[int]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
