"""Kept for the migration history: migration 0010 imports
``TransactionIdField`` from this path, and a migration is never rewritten.
The stream models live in ``django_pgqueue.models.streams``."""

from django_pgqueue.models.streams import TransactionIdField

__all__ = ["TransactionIdField"]
