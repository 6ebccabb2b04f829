"""The admin's forms: the intermediate pages of the actions that ask before
they act (each form says what its page shows), and the dead letter's
payload as JSON text (fix it, then revive)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from django import forms
from django.core.serializers.json import DjangoJSONEncoder
from django.db.models import Q, QuerySet
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest

from django_pgqueue import conf
from django_pgqueue.exceptions import InvalidMessage, SubscriptionError
from django_pgqueue.models import (
    Category,
    DeadLetter,
    DeadLetterState,
    Status,
    SubscriptionState,
)
from django_pgqueue.streams import subscriptions
from django_pgqueue.validation import check_payload

NOTE_MAX_LENGTH = 500


class ActionPageForm(forms.Form):
    """The form of an action's intermediate page (action_form.html), and what
    the page says: its title, the label of its button, and ``text``, the
    summary of the selection: ``{selected}`` is its size and ``{counted}`` how
    many of it match ``counted`` (those the action acts on, or skips)."""

    title = ""
    submit_label = ""
    text = ""
    counted: Q | None = None

    @classmethod
    def for_request(cls, request: HttpRequest, queryset: QuerySet[Any]) -> ActionPageForm:
        """Bound to the page's answer once it was submitted (``apply``), else
        the empty form the page shows."""
        return cls(request.POST) if request.POST.get("apply") else cls()

    def summary(self, queryset: QuerySet[Any]) -> str:
        counted = None if self.counted is None else queryset.filter(self.counted).count()
        return self.text.format(selected=queryset.count(), counted=counted)


# --- dead letters -----------------------------------------------------------------------


class CategoryForm(ActionPageForm):
    title, submit_label = "Set the category of dead letters", "Set category"
    text = "{selected} dead letter(s) selected."

    category = forms.ChoiceField(choices=Category.choices)
    note = forms.CharField(required=False, max_length=NOTE_MAX_LENGTH, help_text="Why (optional).")


class DeadLetterMoveForm(ActionPageForm):
    """Dead-letter by hand: the category they get."""

    submit_label = "Move to dead letters"

    category = forms.ChoiceField(choices=Category.choices, initial=Category.UNKNOWN)


class MessagesMoveForm(DeadLetterMoveForm):
    title = "Move messages to the dead letters"
    text = (
        "{selected} message(s) selected. Waiting (and blocked) ones move to the dead letters "
        "with the category chosen here; {counted} being processed (leased) will be skipped."
    )
    counted = Q(status=Status.PROCESSING)


class CancelForm(ActionPageForm):
    """The confirmation of a cancel: nothing to fill in."""

    title, submit_label = "Cancel messages", "Yes, cancel them"
    text = (
        "{selected} message(s) selected. Waiting, delayed and blocked ones are cancelled at "
        "once and never run; the {counted} being processed are asked to stop (their handler's "
        "cancel_requested()) and end cancelled unless their handler finishes first. Cancelled "
        "messages are kept, in the status cancelled, for CANCELLED_RETENTION."
    )
    counted = Q(status=Status.PROCESSING)


class BlockedEventsMoveForm(DeadLetterMoveForm):
    title = "Move blocked events to the dead letters"
    text = (
        "{counted} of the {selected} selected subscription(s) are blocked: the event each "
        "stopped at goes to the dead letters with the category chosen here, and the "
        "subscription goes on after it. The others are skipped."
    )
    counted = Q(state=SubscriptionState.BLOCKED)


class ResolveForm(ActionPageForm):
    title, submit_label = "Resolve dead letters", "Resolve"
    text = (
        "{counted} of the {selected} selected dead letter(s) will be resolved (the others are "
        "already revived or resolved). They are kept, with your note."
    )
    counted = Q(state=DeadLetterState.NEW)

    note = forms.CharField(max_length=NOTE_MAX_LENGTH, help_text="Why these need no redelivery.")

    def clean_note(self) -> str:
        note = " ".join(self.cleaned_data["note"].split())
        if not note:
            raise forms.ValidationError("Say why they are resolved.")
        return note


class ReviveAgainForm(ActionPageForm):
    """The explicit request to revive dead letters that were revived or
    resolved before (the plain Revive skips them)."""

    title = submit_label = "Revive again"
    text = (
        "{selected} dead letter(s) will be put back into the queue, {counted} of them again "
        "although they were revived or resolved before."
    )
    counted = ~Q(state=DeadLetterState.NEW)

    note = forms.CharField(required=False, max_length=NOTE_MAX_LENGTH)


class ReviveToForm(ActionPageForm):
    title, submit_label = "Revive to another queue or topic", "Revive"
    text = (
        "{selected} dead letter(s) will be revived into the queue and/or topic given here "
        "(new ones only; revived and resolved ones are skipped)."
    )

    queue = forms.CharField(required=False, max_length=conf.QUEUE_MAX_LENGTH)
    topic = forms.CharField(required=False, max_length=conf.TOPIC_MAX_LENGTH)
    note = forms.CharField(required=False, max_length=NOTE_MAX_LENGTH)

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        for kind in ("queue", "topic"):
            value = (data.get(kind) or "").strip()
            data[kind] = value or None
            if value:
                max_length = conf.QUEUE_MAX_LENGTH if kind == "queue" else conf.TOPIC_MAX_LENGTH
                problem = conf.name_problem(kind, value, max_length)
                if problem:
                    self.add_error(kind, problem)
        if not data.get("queue") and not data.get("topic"):
            raise forms.ValidationError("Give a queue, a topic or both.")
        return data


class PrettyJSONField(forms.JSONField):
    """A JSON textarea that shows the value indented; invalid JSON is a form error."""

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, InvalidJSONInput):
            return value
        try:
            return json.dumps(value, indent=2, ensure_ascii=False, cls=self.encoder)
        except RecursionError:  # too deep to indent in the template's stack: one line
            return json.dumps(value, ensure_ascii=False, cls=self.encoder)

    # json.loads raises RecursionError, not a decode error, past Python's
    # nesting limit: a form error, not a server error.
    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError(_TOO_DEEP, code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:
            return InvalidJSONInput(data)


_TOO_DEEP = "The JSON is nested too deeply."


class DeadLetterPayloadForm(forms.ModelForm):
    payload = PrettyJSONField(
        encoder=DjangoJSONEncoder,
        widget=forms.Textarea(attrs={"rows": 16, "cols": 80, "class": "vLargeTextField"}),
        help_text="Fix the payload here, then revive the dead letter.",
    )

    class Meta:
        model = DeadLetter
        fields = ["payload"]

    def clean_payload(self) -> Any:
        payload = self.cleaned_data["payload"]
        try:
            check_payload(payload)  # what enqueue() refuses (NaN, lone surrogates, ...)
        except InvalidMessage as exc:
            raise forms.ValidationError(str(exc)) from None
        return payload

    def clean(self) -> dict[str, Any]:
        super().clean()
        if self.instance.state != DeadLetterState.NEW:
            raise forms.ValidationError(
                f"This dead letter is {self.instance.state}: only a new one's payload can change."
            )
        return self.cleaned_data


# --- stream subscriptions ---------------------------------------------------------------

POSITION_MAX = 2**63 - 1  # a position is a bigint

AFTER, BEGINNING, END = "position", "beginning", "end"


class ResetCheckpointForm(ActionPageForm):
    """Where the selected subscriptions go on from; the position is checked
    against the stored events of each one's stream."""

    title, submit_label = "Reset the checkpoint of subscriptions", "Reset the checkpoint"

    target = forms.ChoiceField(
        choices=[
            (AFTER, "After the event at a position (events after it are delivered)"),
            (BEGINNING, "The beginning: deliver every stored event again"),
            (END, "The end: pass over every event published so far"),
        ],
        initial=AFTER,
        widget=forms.RadioSelect,
    )
    position = forms.IntegerField(
        required=False,
        min_value=0,
        max_value=POSITION_MAX,
        error_messages={
            "invalid": "Give the position as a whole number, such as 1042.",
            "min_value": "A position is 0 (the beginning) or more.",
            "max_value": "No event has a position that large.",
        },
        help_text="The position of a stored event of the subscription's stream (see the "
        "stream events); 0 is the beginning.",
    )

    def __init__(self, *args: Any, streams: Iterable[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.streams = sorted(set(streams))

    @classmethod
    def for_request(cls, request: HttpRequest, queryset: QuerySet[Any]) -> ActionPageForm:
        """The streams of the selection check the position; the page starts at
        the position of the first one's failing event."""
        streams = queryset.values_list("stream", flat=True)
        if request.POST.get("apply"):
            return cls(request.POST, streams=streams)
        failing = queryset.values_list("failing_position", flat=True).first()
        return cls(initial={"position": failing}, streams=streams)

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if data.get("target") != AFTER:
            data["position"] = data.get("target")
            return data
        position = data.get("position")
        if position is None:
            if "position" not in self.errors:
                self.add_error("position", "Give the position to go on after.")
            return data
        for stream in self.streams:
            try:
                subscriptions.checkpoint_for(stream, position)
            except SubscriptionError as exc:
                self.add_error("position", str(exc).capitalize() + ".")
        return data

    def summary(self, queryset: QuerySet[Any]) -> str:
        rows = ", ".join(
            f"{row.name} at position {row.checkpoint_position} (head "
            f"{row.head_position or '-'}, {row.lag} behind)"
            for row in queryset.order_by("name")[:10]
        )
        return (
            f"{queryset.count()} subscription(s): {rows}. Going back delivers events again "
            "(their handlers run again); going forward passes events over without "
            "delivering them. Retrying and blocked subscriptions become active."
        )
