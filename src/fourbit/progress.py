"""Progress lines with rate and time left, for `tail -f` on a rule's log."""

from __future__ import annotations

import logging
import sys
import time

from fourbit.filesystems import explain_disk_full

log = logging.getLogger("fourbit")


class Progress:
    """Report ``done/total`` with a rate and an estimate of the time left.

    Prints at most every ``every_s`` seconds (and always at the end), so a long
    loop costs nothing to instrument.
    """

    def __init__(self, what: str, total: int, unit: str = "it", every_s: float = 5.0):
        self.what, self.total, self.unit, self.every_s = what, total, unit, every_s
        self.start = self.last = time.monotonic()
        self.done = 0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            elapsed = now - self.start
            rate = self.done / elapsed if elapsed > 0 else float("inf")
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            log.info(
                "%s: %d/%d %s (%.1f %s/s, %s elapsed, ~%s left)%s",
                self.what, self.done, self.total, self.unit, rate, self.unit,
                _clock(elapsed), _clock(left), f" {note}" if note else "",
            )


def _clock(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def setup_logging(log_path: str | None = None, *, disk_mb: float | None = None) -> None:
    """Send log lines and stderr (warnings, tracebacks) to a rule's log file; a job that
    fails on a full disk ends its log saying so, with ``disk_mb``, what the rule declares
    the job needs (fourbit.filesystems.explain_disk_full)."""
    if log_path:
        sys.stderr = open(log_path, "a", buffering=1)  # noqa: SIM115  lives as long as the job
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    explain_disk_full(disk_mb)
