from dflash_grpc.v1 import common_pb2 as _common_pb2
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
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CONTEXT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class SpeculativeOptions(_message.Message):
    __slots__ = ("enabled", "tree_budget", "top_k", "max_depth")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    tree_budget: int
    top_k: int
    max_depth: int
    def __init__(self, enabled: _Optional[bool] = ..., tree_budget: _Optional[int] = ..., top_k: _Optional[int] = ..., max_depth: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_tokens", "chat", "max_tokens", "sampling", "stop", "ignore_eos", "speculative", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_tokens: PromptTokens
    chat: Conversation
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    speculative: SpeculativeOptions
    request_id: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_tokens: _Optional[_Union[PromptTokens, _Mapping]] = ..., chat: _Optional[_Union[Conversation, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., speculative: _Optional[_Union[SpeculativeOptions, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class PromptTokens(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Conversation(_message.Message):
    __slots__ = ("messages", "add_generation_prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finished", "finish_reason", "stats", "prompt_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: FinishReason
    stats: AcceptanceStats
    prompt_tokens: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[AcceptanceStats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcceptanceStats(_message.Message):
    __slots__ = ("requests", "prompt_tokens", "generated_tokens", "drafts", "draft_tokens", "accepted_tokens", "accepted_per_position", "drafted_per_position", "mean_acceptance_length", "acceptance_length_histogram", "target_forwards", "wall_time_s", "decode_time_s", "tokens_per_second", "draft_fallbacks", "autoregressive_steps", "draft_time_s", "verify_time_s", "draft_compute_s", "verify_compute_s", "draft_device_s", "verify_device_s")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    AUTOREGRESSIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_TIME_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_DEVICE_S_FIELD_NUMBER: _ClassVar[int]
    requests: int
    prompt_tokens: int
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    drafted_per_position: _containers.RepeatedScalarFieldContainer[int]
    mean_acceptance_length: float
    acceptance_length_histogram: _containers.RepeatedScalarFieldContainer[int]
    target_forwards: int
    wall_time_s: float
    decode_time_s: float
    tokens_per_second: float
    draft_fallbacks: int
    autoregressive_steps: int
    draft_time_s: float
    verify_time_s: float
    draft_compute_s: float
    verify_compute_s: float
    draft_device_s: float
    verify_device_s: float
    def __init__(self, requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., drafted_per_position: _Optional[_Iterable[int]] = ..., mean_acceptance_length: _Optional[float] = ..., acceptance_length_histogram: _Optional[_Iterable[int]] = ..., target_forwards: _Optional[int] = ..., wall_time_s: _Optional[float] = ..., decode_time_s: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., draft_fallbacks: _Optional[int] = ..., autoregressive_steps: _Optional[int] = ..., draft_time_s: _Optional[float] = ..., verify_time_s: _Optional[float] = ..., draft_compute_s: _Optional[float] = ..., verify_compute_s: _Optional[float] = ..., draft_device_s: _Optional[float] = ..., verify_device_s: _Optional[float] = ...) -> None: ...

class ServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("target", "drafter", "version", "scheduler")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.ModelInfo
    drafter: DrafterStatus
    version: str
    scheduler: SchedulerStatus
    def __init__(self, target: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., drafter: _Optional[_Union[DrafterStatus, _Mapping]] = ..., version: _Optional[str] = ..., scheduler: _Optional[_Union[SchedulerStatus, _Mapping]] = ...) -> None: ...

class SchedulerStatus(_message.Message):
    __slots__ = ("active_sessions", "queued_requests", "max_sessions", "max_queue", "ticks", "mean_batch", "tree_budget_now", "drafting", "draft_fallbacks", "ring_rows", "refeatures", "drafter_sessions_given_up", "admitted_plain", "demoted", "no_drafter_slot", "draft_deadline_misses", "tick_seconds", "tick_cpu_seconds", "exchange_seconds", "exchange_cpu_seconds", "verify_queue_seconds", "propose_queue_seconds")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    TICKS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_FIELD_NUMBER: _ClassVar[int]
    TREE_BUDGET_NOW_FIELD_NUMBER: _ClassVar[int]
    DRAFTING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    RING_ROWS_FIELD_NUMBER: _ClassVar[int]
    REFEATURES_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_SESSIONS_GIVEN_UP_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_PLAIN_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    NO_DRAFTER_SLOT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DEADLINE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TICK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TICK_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    queued_requests: int
    max_sessions: int
    max_queue: int
    ticks: int
    mean_batch: float
    tree_budget_now: int
    drafting: bool
    draft_fallbacks: int
    ring_rows: int
    refeatures: int
    drafter_sessions_given_up: int
    admitted_plain: int
    demoted: int
    no_drafter_slot: int
    draft_deadline_misses: int
    tick_seconds: float
    tick_cpu_seconds: float
    exchange_seconds: float
    exchange_cpu_seconds: float
    verify_queue_seconds: float
    propose_queue_seconds: float
    def __init__(self, active_sessions: _Optional[int] = ..., queued_requests: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_queue: _Optional[int] = ..., ticks: _Optional[int] = ..., mean_batch: _Optional[float] = ..., tree_budget_now: _Optional[int] = ..., drafting: _Optional[bool] = ..., draft_fallbacks: _Optional[int] = ..., ring_rows: _Optional[int] = ..., refeatures: _Optional[int] = ..., drafter_sessions_given_up: _Optional[int] = ..., admitted_plain: _Optional[int] = ..., demoted: _Optional[int] = ..., no_drafter_slot: _Optional[int] = ..., draft_deadline_misses: _Optional[int] = ..., tick_seconds: _Optional[float] = ..., tick_cpu_seconds: _Optional[float] = ..., exchange_seconds: _Optional[float] = ..., exchange_cpu_seconds: _Optional[float] = ..., verify_queue_seconds: _Optional[float] = ..., propose_queue_seconds: _Optional[float] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("available", "compatible", "address", "model", "detail")
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    available: bool
    compatible: bool
    address: str
    model: _common_pb2.ModelInfo
    detail: str
    def __init__(self, available: _Optional[bool] = ..., compatible: _Optional[bool] = ..., address: _Optional[str] = ..., model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., detail: _Optional[str] = ...) -> None: ...
