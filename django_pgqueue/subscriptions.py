"""The subscription operations' first documented path, kept so that code
written against it goes on working. They live in
``django_pgqueue.streams.subscriptions``."""

from django_pgqueue.streams.subscriptions import dead_letter_blocked, pause, reset, resume

__all__ = ["dead_letter_blocked", "pause", "reset", "resume"]
