"""Defaults that the services and their clients share: where each service listens, the address
a client calls by default, and the bounds the orchestrator puts on client-supplied numbers.

The services' configs (:class:`target_service.config.TargetConfig`,
:class:`draft_service.config.DraftConfig`, :class:`orchestrator.config.OrchestratorConfig`) take
their ``host`` and ``port`` defaults from here, and so do the SDK and the ``dflash-grpc`` command,
which may import only :mod:`dflash_grpc`. Imports nothing.
"""

from __future__ import annotations

#: Interface every service listens on by default (loopback: plaintext is allowed there only).
DEFAULT_HOST = "127.0.0.1"
#: Port of the public GenerationService (``python -m orchestrator``).
ORCHESTRATOR_PORT = 50051
#: Port of the TargetService (``python -m target_service``).
TARGET_PORT = 50052
#: Port of the DraftService (``python -m draft_service``).
DRAFT_PORT = 50053
#: ``host:port`` a client calls when given none: the orchestrator on loopback.
DEFAULT_ADDRESS = f"{DEFAULT_HOST}:{ORCHESTRATOR_PORT}"

#: Bounds of client-supplied numbers in a ``GenerateRequest`` (beyond them the orchestrator answers
#: INVALID_ARGUMENT): tree budget, draft top-k and depth (inclusive maxima), how many stop strings
#: and characters per stop string, characters of a ``request_id``. Two bound the size of a chat and
#: are checked before anything is tokenized, like the prompt's characters (beyond them:
#: RESOURCE_EXHAUSTED, reason ``PROMPT_TOO_LONG``): chat messages, characters of a message's role.
#: ``max_tokens`` is further bounded by the target's context; prompts by the orchestrator's
#: ``--max-prompt-chars`` (characters, before tokenizing), the context (tokens) and
#: ``--max-request-bytes`` (the whole message).
REQUEST_LIMITS = {"tree_budget": 1024, "top_k": 1024, "max_depth": 1024, "stop_strings": 16, "stop_chars": 1024,
                  "request_id_chars": 128, "chat_messages": 1024, "chat_role_chars": 64}
