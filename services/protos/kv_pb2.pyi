from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class IndexMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_MODE_UNSPECIFIED: _ClassVar[IndexMode]
    INDEX_MODE_COPIED: _ClassVar[IndexMode]
    INDEX_MODE_SPLIT: _ClassVar[IndexMode]
INDEX_MODE_UNSPECIFIED: IndexMode
INDEX_MODE_COPIED: IndexMode
INDEX_MODE_SPLIT: IndexMode

class RankEndpoint(_message.Message):
    __slots__ = ("session", "latent_ptr", "rows", "latent_row_bytes", "index_ptrs", "index_rows", "index_row_bytes")
    class IndexPtrsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LATENT_PTR_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    LATENT_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_PTRS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ROWS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    session: str
    latent_ptr: int
    rows: int
    latent_row_bytes: int
    index_ptrs: _containers.ScalarMap[int, int]
    index_rows: int
    index_row_bytes: int
    def __init__(self, session: _Optional[str] = ..., latent_ptr: _Optional[int] = ..., rows: _Optional[int] = ..., latent_row_bytes: _Optional[int] = ..., index_ptrs: _Optional[_Mapping[int, int]] = ..., index_rows: _Optional[int] = ..., index_row_bytes: _Optional[int] = ...) -> None: ...

class LayoutFingerprint(_message.Message):
    __slots__ = ("model", "dtype", "latent_dim", "index_head_dim", "num_layers", "indexer_layers", "kv_cache_dtype", "kv_entry_bytes", "kv_index_bytes", "kv_scales")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LATENT_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    INDEXER_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_ENTRY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    latent_dim: int
    index_head_dim: int
    num_layers: int
    indexer_layers: _containers.RepeatedScalarFieldContainer[int]
    kv_cache_dtype: str
    kv_entry_bytes: int
    kv_index_bytes: int
    kv_scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., latent_dim: _Optional[int] = ..., index_head_dim: _Optional[int] = ..., num_layers: _Optional[int] = ..., indexer_layers: _Optional[_Iterable[int]] = ..., kv_cache_dtype: _Optional[str] = ..., kv_entry_bytes: _Optional[int] = ..., kv_index_bytes: _Optional[int] = ..., kv_scales: _Optional[_Iterable[float]] = ...) -> None: ...

class KvDestination(_message.Message):
    __slots__ = ("reservation_id", "dcp", "page_size", "index_mode", "slots", "prefix_tokens", "ranks", "fingerprint", "expires_at_unix_s", "decode_address")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DCP_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    INDEX_MODE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    dcp: int
    page_size: int
    index_mode: IndexMode
    slots: _containers.RepeatedScalarFieldContainer[int]
    prefix_tokens: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankEndpoint]
    fingerprint: LayoutFingerprint
    expires_at_unix_s: float
    decode_address: str
    def __init__(self, reservation_id: _Optional[str] = ..., dcp: _Optional[int] = ..., page_size: _Optional[int] = ..., index_mode: _Optional[_Union[IndexMode, str]] = ..., slots: _Optional[_Iterable[int]] = ..., prefix_tokens: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankEndpoint, _Mapping]]] = ..., fingerprint: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., expires_at_unix_s: _Optional[float] = ..., decode_address: _Optional[str] = ...) -> None: ...
