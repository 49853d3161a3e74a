"""Draft service: the DFlash drafter, per-session drafter contexts, tree building, gRPC servicer.

Modules: :mod:`draft_service.drafter` (the model), :mod:`draft_service.gguf_io` (drafter files),
:mod:`draft_service.init_random` (random drafters), :mod:`draft_service.tree` (chains and DDTrees),
:mod:`draft_service.batched` (the reference and the batched GPU draft engines),
:mod:`draft_service.servicer` (``DraftService``), ``python -m draft_service`` (the server).
"""

from __future__ import annotations

import glob
import logging
import os

from runtime.defaults import cache_dir

logger = logging.getLogger(__name__)

#: Shipped (trained) drafters: ``draft_service/data/*.gguf``, matched to a target by fingerprint.
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def shipped_drafter(target_fingerprint: str) -> str | None:
    """Path of a drafter in :data:`DATA_DIR` whose ``dflash.target_fingerprint`` is
    ``target_fingerprint`` (the first in name order), or None."""
    from runtime.gguf_loader import GGUFFile, open_gguf

    for path in sorted(glob.glob(os.path.join(DATA_DIR, "*.gguf"))):
        try:
            if open_gguf(path).get("dflash.target_fingerprint") == target_fingerprint:
                return path
        except Exception:  # noqa: BLE001 - a broken file in data/ must not hide the others
            logger.warning("unreadable drafter in data dir", extra={"path": path}, exc_info=True)
    return None


def default_drafter_path(target_path: str | None = None) -> str:
    """Path of the default drafter for a target.

    A drafter shipped in ``draft_service/data/`` for that target (same model fingerprint) wins.
    Otherwise a random, **untrained** drafter (:func:`draft_service.init_random.write_random_drafter`
    with default options, seed 0) is created once under :func:`cache_dir` as
    ``drafters/dflash-random-<fingerprint[:16]>.gguf`` and reused; a WARNING says it is untrained
    (it proposes almost nothing the target accepts).

    Args:
        target_path: the target GGUF; None = :func:`runtime.defaults.default_model_path`.
    """
    from runtime.defaults import default_model_path
    from runtime.fingerprint import model_fingerprint
    from runtime.gguf_loader import GGUFFile, open_gguf

    target_path = target_path or default_model_path()
    target = open_gguf(target_path)
    fp = model_fingerprint(target)
    shipped = shipped_drafter(fp)
    if shipped:
        return shipped
    path = os.path.join(cache_dir(), "drafters", f"dflash-random-{fp[:16]}.gguf")
    if not os.path.exists(path):
        from draft_service.init_random import write_random_drafter

        write_random_drafter(target, path)
    logger.warning(
        "no trained drafter for this target: using a random, untrained one (acceptance will be near zero)",
        extra={"drafter": path, "target": target_path},
    )
    return path
