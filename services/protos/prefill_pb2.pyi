from . import common_pb2 as _common_pb2
from . import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling", "destination", "num_forks", "output_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.Sampling
    destination: _kv_pb2.KvDestination
    num_forks: int
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.Sampling, _Mapping]] = ..., destination: _Optional[_Union[_kv_pb2.KvDestination, _Mapping]] = ..., num_forks: _Optional[int] = ..., output_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class ForkStart(_message.Message):
    __slots__ = ("token", "seed", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    seed: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token: _Optional[int] = ..., seed: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "seed", "prefill_ms", "transfer_bytes", "transfer_ms", "cached_tokens", "queue_ms", "compute_ms", "handoff_ms", "service_ms", "first_logprob", "prompt_logprobs", "forks", "decode_cached_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    SERVICE_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    seed: int
    prefill_ms: float
    transfer_bytes: int
    transfer_ms: float
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    handoff_ms: float
    service_ms: float
    first_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    forks: _containers.RepeatedCompositeFieldContainer[ForkStart]
    decode_cached_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., seed: _Optional[int] = ..., prefill_ms: _Optional[float] = ..., transfer_bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., handoff_ms: _Optional[float] = ..., service_ms: _Optional[float] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., forks: _Optional[_Iterable[_Union[ForkStart, _Mapping]]] = ..., decode_cached_tokens: _Optional[int] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("model", "cp", "queue_depth", "rows_used", "rows_free", "serving", "rows_cached", "prefix_cache_queries", "prefix_cache_hits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ROWS_USED_FIELD_NUMBER: _ClassVar[int]
    ROWS_FREE_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    ROWS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    cp: int
    queue_depth: int
    rows_used: int
    rows_free: int
    serving: bool
    rows_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, model: _Optional[str] = ..., cp: _Optional[int] = ..., queue_depth: _Optional[int] = ..., rows_used: _Optional[int] = ..., rows_free: _Optional[int] = ..., serving: _Optional[bool] = ..., rows_cached: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
