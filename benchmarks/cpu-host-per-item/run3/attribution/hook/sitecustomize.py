"""Attribution only (benchmarks/cpu-host-per-item/run3/README.md): with HISTORY_BYTES set, the
orchestrator process of tools/host_per_item.py builds its Scheduler with that history_bytes (0: no
feature history kept beyond the rows the drafter has not had: no resync after a drafter failure).
Used as PYTHONPATH=benchmarks/cpu-host-per-item/run3/attribution/hook:.:proto."""
import os
import sys

if os.environ.get("HISTORY_BYTES") and "--role" in sys.argv and "orchestrator" in sys.argv:
    from orchestrator import scheduler as _s

    _init = _s.Scheduler.__init__

    def _with_history(self, *a, **k):
        k["history_bytes"] = int(os.environ["HISTORY_BYTES"])
        _init(self, *a, **k)

    _s.Scheduler.__init__ = _with_history
