"""Who owns each session, and leases (docs/ARCHITECTURE.md, "Owners, leases and shutdown").

A session belongs to the caller that opened it: the target's Prefill, the drafter's first
Propose of a session id. The caller says who it is in two metadata keys of every call:

* ``dflash-owner`` (:data:`OWNER_KEY`): a name stable across restarts of the same client (the
  orchestrator's ``--instance-name``, by default ``orchestrator@<host>:<port>``);
* ``dflash-owner-epoch`` (:data:`EPOCH_KEY`): new at each start of that client (a uuid4 hex).

A call without them is the anonymous owner ``Owner("", "")``: it may touch only sessions opened
anonymously, and its sessions have no lease (only the step loop's idle reaper frees them).

:class:`Owners` keeps, for one service, session id -> owner and, per owner, the calls in flight
and the time of its last call. It decides, never acts: the step loop
(:class:`runtime.step_loop.StepLoop`) asks it and releases on its own thread.

* **Ownership.** A Verify / Propose item or a Release naming a session of another owner is
  refused for that item (:class:`NotOwner`: PERMISSION_DENIED, reason ``NOT_OWNER``) and the
  session is not touched. A session without a record (opened in-process, without a call) is
  recorded by the first caller that uses it successfully.
* **Leases.** An owner with a name and no call in flight (an open Verify or Propose stream is a
  call in flight) for ``lease_s`` seconds loses all its sessions (:meth:`Owners.expired`).
* **Epochs.** A call with a known name and an epoch not seen before for it makes every session
  of that name's older epochs stale at once (:meth:`Owners.call_started` returns them): a
  restarted client frees its predecessor's sessions with its first call. An epoch that was
  superseded never supersedes again (two live clients misconfigured with one name do not free
  each other's sessions back and forth; each keeps what it opens).

Imports nothing but the standard library and :mod:`runtime.errors` (no torch).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Iterable, NamedTuple

from runtime.errors import Code, EngineError, Reason

#: Metadata key of the caller's name (stable across its restarts).
OWNER_KEY = "dflash-owner"
#: Metadata key of the caller's epoch (new at each of its starts).
EPOCH_KEY = "dflash-owner-epoch"
#: Superseded epochs remembered per name (older ones are forgotten).
RETIRED_EPOCHS = 16
#: Seconds after which an owner that holds nothing and makes no call is forgotten (its name's
#: epochs too, once no owner of that name is left), so that the bookkeeping stays bounded.
QUIET_S = 60.0


class Owner(NamedTuple):
    """A caller: ``name`` (``""``: anonymous) and ``epoch`` (``""``: none given)."""

    name: str
    epoch: str

    @property
    def anonymous(self) -> bool:
        return not self.name

    def __str__(self) -> str:
        return f"{self.name or '(anonymous)'}#{self.epoch[:8]}" if self.epoch else (self.name or "(anonymous)")


ANONYMOUS = Owner("", "")


def owner_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Owner:
    """The :class:`Owner` named by call metadata (``context.invocation_metadata()``); missing keys
    are ``""``, values are cut to 256 characters."""
    name = epoch = ""
    for key, value in metadata or ():
        if isinstance(value, bytes):
            continue
        if key == OWNER_KEY:
            name = value[:256]
        elif key == EPOCH_KEY:
            epoch = value[:256]
    return Owner(name, epoch)


def caller(context) -> Owner:
    """The :class:`Owner` of a gRPC call (its ``invocation_metadata``)."""
    md = getattr(context, "invocation_metadata", None)
    return owner_from_metadata(md() if md is not None else None)


class NotOwner(EngineError):
    """PERMISSION_DENIED, reason ``NOT_OWNER``: the session belongs to another owner; it was not
    touched."""

    code = Code.PERMISSION_DENIED
    reason = Reason.NOT_OWNER


class Owners:
    """Session owners and leases of one service (thread-safe).

    Args:
        lease_s: seconds an owner with a name may go without a call in flight before its
            sessions expire (0: leases off).
        clock: monotonic seconds (tests inject a fake one).
    """

    def __init__(self, lease_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.lease_s = float(lease_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._session: dict[str, Owner] = {}
        self._by_owner: dict[Owner, set[str]] = collections.defaultdict(set)
        self._active: dict[Owner, int] = collections.defaultdict(int)
        self._last: dict[Owner, float] = {}
        self._epoch: dict[str, str] = {}                      # name -> its newest epoch
        self._retired: dict[str, collections.deque] = {}      # name -> superseded epochs
        #: sessions released for an expired lease, and for a superseded epoch
        self.expired_sessions = 0
        self.superseded_sessions = 0

    # ------------------------------------------------------------------ sessions
    def owner_of(self, session_id: str) -> Owner | None:
        """The recorded owner of a session (None: no record)."""
        with self._lock:
            return self._session.get(session_id)

    def may_touch(self, session_id: str, owner: Owner | None) -> bool:
        """Whether ``owner`` may use or release the session: no record, the same owner, or
        ``owner`` None (an in-process caller, trusted)."""
        if owner is None:
            return True
        with self._lock:
            rec = self._session.get(session_id)
        return rec is None or rec == owner

    def foreign(self, session_ids: Iterable[str], owner: Owner | None) -> set[str]:
        """Those of ``session_ids`` that ``owner`` may not touch (:meth:`may_touch`), in one look."""
        if owner is None:
            return set()
        with self._lock:
            return {sid for sid in session_ids if self._session.get(sid, owner) != owner}

    def claim(self, session_ids: Iterable[str], owner: Owner | None) -> None:
        """Record ``owner`` for those of ``session_ids`` that have no owner yet (sessions it just
        used successfully: a new drafter session, a session opened in-process), in one look."""
        if owner is None:
            return
        with self._lock:
            for sid in session_ids:
                if sid and sid not in self._session:
                    self._session[sid] = owner
                    self._by_owner[owner].add(sid)
            self._last.setdefault(owner, self.clock())

    def record(self, session_id: str, owner: Owner | None, *, replace: bool = True) -> None:
        """Note ``owner`` as the session's owner (``replace`` False: only if it has none);
        ``owner`` None is a no-op."""
        if owner is None or not session_id:
            return
        with self._lock:
            old = self._session.get(session_id)
            if old == owner or (old is not None and not replace):
                return
            if old is not None:
                self._by_owner[old].discard(session_id)
            self._session[session_id] = owner
            self._by_owner[owner].add(session_id)
            self._last.setdefault(owner, self.clock())

    def forget(self, session_ids: Iterable[str]) -> None:
        """Drop the records of released sessions."""
        with self._lock:
            for sid in session_ids:
                old = self._session.pop(sid, None)
                if old is not None:
                    self._by_owner[old].discard(sid)

    def keep_only(self, live: Iterable[str]) -> list[str]:
        """Drop the records of sessions not in ``live`` (the engine's); returns their ids."""
        live = set(live)
        with self._lock:
            gone = [sid for sid in self._session if sid not in live]
        self.forget(gone)
        return gone

    def sessions_of(self, owner: Owner) -> list[str]:
        """The sessions recorded for ``owner``."""
        with self._lock:
            return sorted(self._by_owner.get(owner, ()))

    def count(self) -> int:
        """Sessions with a record."""
        with self._lock:
            return len(self._session)

    # ------------------------------------------------------------------ calls
    def call_started(self, owner: Owner) -> list[str]:
        """A call of ``owner`` begins (end it with :meth:`call_ended`). Returns the sessions made
        stale by it, to be released now: those of the name's older epochs when ``owner`` carries
        a new epoch of a known name (else ``[]``); they are forgotten here."""
        stale: list[str] = []
        with self._lock:
            self._active[owner] += 1
            self._last[owner] = self.clock()
            name, epoch = owner
            if not name or not epoch:
                return stale
            current = self._epoch.get(name)
            retired = self._retired.setdefault(name, collections.deque(maxlen=RETIRED_EPOCHS))
            if current == epoch or epoch in retired:
                return stale
            self._epoch[name] = epoch
            if current is not None:
                retired.append(current)
            for other in [o for o in self._by_owner if o.name == name and o.epoch != epoch]:
                ids = self._by_owner.pop(other)
                for sid in ids:
                    self._session.pop(sid, None)
                stale.extend(sorted(ids))
                if not self._active.get(other):
                    self._active.pop(other, None)
                    self._last.pop(other, None)
            self.superseded_sessions += len(stale)
        return stale

    def call_ended(self, owner: Owner) -> None:
        """A call of ``owner`` ended (however): its lease runs from now if it was its last."""
        with self._lock:
            n = self._active.get(owner, 0) - 1
            if n > 0:
                self._active[owner] = n
            else:
                self._active.pop(owner, None)
            self._last[owner] = self.clock()

    def in_flight(self, owner: Owner | None = None) -> int:
        """Calls in flight: of ``owner``, or of every owner."""
        with self._lock:
            return self._active.get(owner, 0) if owner is not None else sum(self._active.values())

    def expired(self) -> list[tuple[Owner, list[str]]]:
        """Owners whose lease ran out (a name, sessions, no call in flight for ``lease_s``
        seconds) with their sessions, which are forgotten here (release them). Empty when
        leases are off."""
        now = self.clock()
        out = []
        with self._lock:
            quiet = [o for o, t in self._last.items()   # owners that hold nothing and went quiet: forget them
                     if not self._by_owner.get(o) and not self._active.get(o) and now - t > max(self.lease_s, QUIET_S)]
            for owner in quiet:
                self._last.pop(owner, None)
                self._by_owner.pop(owner, None)
            if quiet:
                names = {o.name for o in self._last}
                for name in [n for n in self._epoch if n not in names]:
                    del self._epoch[name]
                    self._retired.pop(name, None)
            if self.lease_s <= 0:
                return out
            for owner, ids in list(self._by_owner.items()):
                if owner.anonymous or self._active.get(owner):
                    continue
                if not ids or now - self._last.get(owner, now) <= self.lease_s:
                    continue
                del self._by_owner[owner]
                for sid in ids:
                    self._session.pop(sid, None)
                out.append((owner, sorted(ids)))
                self.expired_sessions += len(ids)
        return out


__all__ = ["ANONYMOUS", "EPOCH_KEY", "NotOwner", "OWNER_KEY", "Owner", "Owners", "caller", "owner_from_metadata"]
