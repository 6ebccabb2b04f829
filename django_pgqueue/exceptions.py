"""Exceptions raised by django-pgqueue.

Each class's docstring is its default message, so ``raise InvalidMessage()``
still says something useful.
"""


class PgQueueError(Exception):
    """A django-pgqueue error."""

    def __init__(self, message=None):
        super().__init__(message if message is not None else self.__doc__)


class InvalidMessage(PgQueueError, ValueError):
    """The message cannot be enqueued as given; nothing was written."""
