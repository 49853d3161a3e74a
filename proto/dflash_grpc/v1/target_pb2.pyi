from dflash_grpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TargetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillItem(_message.Message):
    __slots__ = ("session_id", "prompt_tokens", "sampling", "feature_layer_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    feature_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., feature_layer_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("items", "feature_ring")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_RING_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PrefillItem]
    feature_ring: bool
    def __init__(self, items: _Optional[_Iterable[_Union[PrefillItem, _Mapping]]] = ..., feature_ring: _Optional[bool] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("session_id", "first_token", "committed_length", "features", "ring_slot", "ring_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RING_SLOT_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token: int
    committed_length: int
    features: _common_pb2.Tensor
    ring_slot: int
    ring_rows: int
    def __init__(self, session_id: _Optional[str] = ..., first_token: _Optional[int] = ..., committed_length: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ring_slot: _Optional[int] = ..., ring_rows: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("results", "ring")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[PrefillResult]
    ring: _common_pb2.FeatureRing
    def __init__(self, results: _Optional[_Iterable[_Union[PrefillResult, _Mapping]]] = ..., ring: _Optional[_Union[_common_pb2.FeatureRing, _Mapping]] = ...) -> None: ...

class VerifyItem(_message.Message):
    __slots__ = ("session_id", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tree: _common_pb2.TokenTree
    def __init__(self, session_id: _Optional[str] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("items", "columns", "stop_features", "feature_ring", "ring_off")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    STOP_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_RING_FIELD_NUMBER: _ClassVar[int]
    RING_OFF_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifyItem]
    columns: VerifyColumns
    stop_features: _containers.RepeatedScalarFieldContainer[str]
    feature_ring: bool
    ring_off: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, items: _Optional[_Iterable[_Union[VerifyItem, _Mapping]]] = ..., columns: _Optional[_Union[VerifyColumns, _Mapping]] = ..., stop_features: _Optional[_Iterable[str]] = ..., feature_ring: _Optional[bool] = ..., ring_off: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyColumns(_message.Message):
    __slots__ = ("session_ids", "trees")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    trees: _common_pb2.TreeColumns
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., trees: _Optional[_Union[_common_pb2.TreeColumns, _Mapping]] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("session_id", "status", "accepted_tokens", "accepted_nodes", "bonus_token", "committed_length", "features", "ring_slot", "ring_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    RING_SLOT_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.ItemStatus
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    committed_length: int
    features: _common_pb2.Tensor
    ring_slot: int
    ring_rows: int
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.ItemStatus, _Mapping]] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., committed_length: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., ring_slot: _Optional[int] = ..., ring_rows: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("results", "compute_s", "batch_items", "queue_s", "device_s", "columns", "ring")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    compute_s: float
    batch_items: int
    queue_s: float
    device_s: float
    columns: VerifyResultColumns
    ring: _common_pb2.FeatureRing
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., compute_s: _Optional[float] = ..., batch_items: _Optional[int] = ..., queue_s: _Optional[float] = ..., device_s: _Optional[float] = ..., columns: _Optional[_Union[VerifyResultColumns, _Mapping]] = ..., ring: _Optional[_Union[_common_pb2.FeatureRing, _Mapping]] = ...) -> None: ...

class VerifyResultColumns(_message.Message):
    __slots__ = ("refused", "accepted", "accepted_tokens", "accepted_nodes", "bonus_tokens", "committed_lengths", "features")
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    refused: _containers.RepeatedCompositeFieldContainer[_common_pb2.IndexedStatus]
    accepted: bytes
    accepted_tokens: bytes
    accepted_nodes: bytes
    bonus_tokens: bytes
    committed_lengths: bytes
    features: _common_pb2.FeatureColumns
    def __init__(self, refused: _Optional[_Iterable[_Union[_common_pb2.IndexedStatus, _Mapping]]] = ..., accepted: _Optional[bytes] = ..., accepted_tokens: _Optional[bytes] = ..., accepted_nodes: _Optional[bytes] = ..., bonus_tokens: _Optional[bytes] = ..., committed_lengths: _Optional[bytes] = ..., features: _Optional[_Union[_common_pb2.FeatureColumns, _Mapping]] = ...) -> None: ...
