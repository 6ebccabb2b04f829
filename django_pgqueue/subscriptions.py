"""Kept only as the first documented path of the subscription operations.

Code written against it goes on working; the operations live in
``django_pgqueue.streams.subscriptions``."""

from django_pgqueue.streams.subscriptions import dead_letter_blocked, pause, reset, resume

__all__ = ["dead_letter_blocked", "pause", "reset", "resume"]
