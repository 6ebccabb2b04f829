"""What one revive(), resolve() or categorize() call did: ``TriageResult``,
and the reasons it counts the rows it left alone by."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

# Why a row was left alone: the keys of TriageResult.skipped.
ALREADY_REVIVED = "already revived"
IS_RESOLVED = "resolved"
DUPLICATE = "duplicate"  # an unfinished message holds the same topic and dedup_key
INVALID = "invalid"  # the message could not be enqueued as it is (see the log)
ALREADY_RESOLVED = "already resolved"
IS_REVIVED = "revived"
UNCHANGED = "category unchanged"
GONE = "gone"  # deleted (purged) between the selection and the lock

_PAST = {"revive": "revived", "resolve": "resolved", "categorize": "categorized"}


@dataclass
class TriageResult:
    """What one revive(), resolve() or categorize() call did (or, with
    ``dry_run``, would do): ``done`` rows changed, ``skipped`` rows by reason."""

    action: str
    dry_run: bool = False
    done: int = 0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def total(self) -> int:
        return self.done + sum(self.skipped.values())

    def __str__(self) -> str:
        would = "would " if self.dry_run else ""
        text = f"{would}{self.action if self.dry_run else _PAST[self.action]} {self.done}"
        skipped = sum(self.skipped.values())
        text += f", {would}{'skip' if self.dry_run else 'skipped'} {skipped}"
        if skipped:
            reasons = ", ".join(f"{r}: {n}" for r, n in sorted(self.skipped.items()))
            text += f" ({reasons})"
        return ("dry run: " if self.dry_run else "") + text
