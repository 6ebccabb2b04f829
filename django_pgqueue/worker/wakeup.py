"""What wakes the worker's main loop from its wait, and whether it should
claim once awake.

Any thread may wake it (``set``): a handler thread whose job freed a slot,
the listener, ``stop()``, the stream delivery thread in --burst. Two
reasons to claim outlive the wake-up that brought them: a notification
named one of its queues (``notify``), and a message group may go on
(``release_groups``: the next claim promotes the group's next message, in
its round trip). ``groups_released`` is written by those two methods only.
"""

from __future__ import annotations

import threading


class Wakeup:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._notified = False  # a NOTIFY named one of its queues
        self.groups_released = False  # the next claim promotes released groups' next

    def set(self) -> None:
        """Wake the loop (it looks at what changed: free slots, due acknowledgements)."""
        # A handler thread calls this per message. Skipping it while the
        # event is still set loses nothing: the loop clears the event before
        # it looks at what changed, so it sees this caller's change too.
        if not self._event.is_set():
            self._event.set()

    def notify(self) -> None:
        """Wake the loop to claim: messages are ready in one of its queues."""
        with self._lock:
            self._notified = True
        self._event.set()

    def release_groups(self) -> None:
        """A message group may go on (its message was acknowledged or
        dead-lettered, a grouped message arrived, a promotion left some
        over): wake the loop to claim, the claim promoting first."""
        with self._lock:
            self.groups_released = True
        self._event.set()

    def take_groups(self) -> bool:
        """Whether groups were released since the last call (the claim that
        promotes them asks)."""
        with self._lock:
            released, self.groups_released = self.groups_released, False
        return released

    def wait(self, timeout: float) -> bool:
        """Wait until woken or ``timeout`` seconds passed; returns whether
        there is a reason to claim (a notification, released groups)."""
        self._event.wait(timeout)
        self._event.clear()
        with self._lock:
            hint = self._notified or self.groups_released
            self._notified = False
        return hint
