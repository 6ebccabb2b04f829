"""Kept only for migration 0010, which imports ``TransactionIdField`` from here.

A migration is never rewritten, so this path must stay importable (it
cannot move under ``migrations/``). The stream models live in
``django_pgqueue.models.streams``."""

from django_pgqueue.models.streams import TransactionIdField

__all__ = ["TransactionIdField"]
