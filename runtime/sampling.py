"""Sampling settings of a session and their limits, shared by both services and the orchestrator
(which checks requests before any engine sees them). Imports no torch.
"""

from __future__ import annotations

import dataclasses
import random

from runtime.errors import InvalidArgument, Reason

#: Smallest positive temperature: logits / T stay far inside float32 (|logit| < 1e3 gives < 1e7).
MIN_TEMPERATURE = 1e-4


@dataclasses.dataclass
class Sampling:
    """Validated sampling settings of a session (``temperature == 0``: greedy)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0

    @classmethod
    def checked(cls, temperature: float, top_k: int, top_p: float, seed: int | None) -> "Sampling":
        """Validate and build; unset ``seed`` draws a random one.

        Raises:
            InvalidArgument (reason ``INVALID_SAMPLING``): temperature < 0, not finite, or in
                (0, ``MIN_TEMPERATURE``) (its inverse scales logits past float32), top_k < 0,
                top_p outside [0, 1].
        """
        if not (temperature >= 0.0 and temperature < float("inf")):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {temperature}", reason=Reason.INVALID_SAMPLING)
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise InvalidArgument(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature}", reason=Reason.INVALID_SAMPLING)
        if top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {top_k}", reason=Reason.INVALID_SAMPLING)
        if not 0.0 <= top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1], got {top_p}", reason=Reason.INVALID_SAMPLING)
        return cls(float(temperature), int(top_k), float(top_p), int(seed if seed is not None else random.getrandbits(63)))
