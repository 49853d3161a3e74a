from dflash_grpc.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterInfo(_message.Message):
    __slots__ = ("model", "target_fingerprint", "target_layer_ids", "mask_token_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_LAYER_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    target_fingerprint: str
    target_layer_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_token_id: int
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., target_fingerprint: _Optional[str] = ..., target_layer_ids: _Optional[_Iterable[int]] = ..., mask_token_id: _Optional[int] = ...) -> None: ...

class TreeParams(_message.Message):
    __slots__ = ("budget", "top_k", "max_depth")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    budget: int
    top_k: int
    max_depth: int
    def __init__(self, budget: _Optional[int] = ..., top_k: _Optional[int] = ..., max_depth: _Optional[int] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("session_id", "features", "root_token", "committed_length", "tree", "ring_slot", "ring_rows")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    RING_SLOT_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    features: _common_pb2.Tensor
    root_token: int
    committed_length: int
    tree: TreeParams
    ring_slot: int
    ring_rows: int
    def __init__(self, session_id: _Optional[str] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., root_token: _Optional[int] = ..., committed_length: _Optional[int] = ..., tree: _Optional[_Union[TreeParams, _Mapping]] = ..., ring_slot: _Optional[int] = ..., ring_rows: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items", "columns", "ring")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    columns: ProposeColumns
    ring: _common_pb2.FeatureRing
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ..., columns: _Optional[_Union[ProposeColumns, _Mapping]] = ..., ring: _Optional[_Union[_common_pb2.FeatureRing, _Mapping]] = ...) -> None: ...

class ProposeColumns(_message.Message):
    __slots__ = ("session_ids", "root_tokens", "committed_lengths", "budgets", "top_ks", "max_depths", "features")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    ROOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    TOP_KS_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    root_tokens: bytes
    committed_lengths: bytes
    budgets: bytes
    top_ks: bytes
    max_depths: bytes
    features: _common_pb2.FeatureColumns
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., root_tokens: _Optional[bytes] = ..., committed_lengths: _Optional[bytes] = ..., budgets: _Optional[bytes] = ..., top_ks: _Optional[bytes] = ..., max_depths: _Optional[bytes] = ..., features: _Optional[_Union[_common_pb2.FeatureColumns, _Mapping]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("session_id", "status", "tree")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.ItemStatus
    tree: _common_pb2.TokenTree
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.ItemStatus, _Mapping]] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results", "compute_s", "batch_items", "queue_s", "device_s", "refused", "trees")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    compute_s: float
    batch_items: int
    queue_s: float
    device_s: float
    refused: _containers.RepeatedCompositeFieldContainer[_common_pb2.IndexedStatus]
    trees: _common_pb2.TreeColumns
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ..., compute_s: _Optional[float] = ..., batch_items: _Optional[int] = ..., queue_s: _Optional[float] = ..., device_s: _Optional[float] = ..., refused: _Optional[_Iterable[_Union[_common_pb2.IndexedStatus, _Mapping]]] = ..., trees: _Optional[_Union[_common_pb2.TreeColumns, _Mapping]] = ...) -> None: ...
