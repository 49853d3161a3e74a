"""The shared runtime floor both services stand on (docs/ARCHITECTURE.md, "Packages").

One concept per module: :mod:`runtime.errors` (refusals with a status and a reason code),
:mod:`runtime.sampling` (sampling settings and their limits), :mod:`runtime.gguf_loader`,
:mod:`runtime.tokenizer`, :mod:`runtime.fingerprint`, :mod:`runtime.defaults` (default model,
cache directory), :mod:`runtime.config` (service config dataclasses as command-line flags),
:mod:`runtime.tree` (token-tree checks and depths), :mod:`runtime.pool` (the state pool),
:mod:`runtime.graphs` (bucketed step runners and CUDA graphs), :mod:`runtime.step_loop` (the
thread that owns the device) and :mod:`runtime.status` (errors as gRPC statuses).

Importing this package, or its torch-free modules (errors, sampling, defaults, config,
gguf_loader, tokenizer, fingerprint, tree), imports no torch: the orchestrator stands on them
without a model.
"""
