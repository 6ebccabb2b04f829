"""The admin's forms: the intermediate pages of the triage actions, and the
dead letter's payload as JSON text (fix it, then revive)."""

import json

from django import forms
from django.core.serializers.json import DjangoJSONEncoder
from django.forms.fields import InvalidJSONInput

from django_pgqueue import conf
from django_pgqueue.enqueuing import check_payload
from django_pgqueue.exceptions import InvalidMessage
from django_pgqueue.models import Category, DeadLetter, DeadLetterState


class CategoryForm(forms.Form):
    category = forms.ChoiceField(choices=Category.choices)
    note = forms.CharField(required=False, max_length=500, help_text="Why (optional).")


class DeadLetterMoveForm(forms.Form):
    """Dead-letter messages by hand: the category they get."""

    category = forms.ChoiceField(choices=Category.choices, initial=Category.UNKNOWN)


class ResolveForm(forms.Form):
    note = forms.CharField(max_length=500, help_text="Why these need no redelivery.")

    def clean_note(self):
        note = " ".join(self.cleaned_data["note"].split())
        if not note:
            raise forms.ValidationError("Say why they are resolved.")
        return note


class ReviveAgainForm(forms.Form):
    """The explicit request to revive dead letters that were revived or
    resolved before (the plain Revive skips them)."""

    note = forms.CharField(required=False, max_length=500)


class ReviveToForm(forms.Form):
    queue = forms.CharField(required=False, max_length=conf.QUEUE_MAX_LENGTH)
    topic = forms.CharField(required=False, max_length=conf.TOPIC_MAX_LENGTH)
    note = forms.CharField(required=False, max_length=500)

    def clean(self):
        data = super().clean()
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

    def prepare_value(self, value):
        if isinstance(value, InvalidJSONInput):
            return value
        try:
            return json.dumps(value, indent=2, ensure_ascii=False, cls=self.encoder)
        except RecursionError:  # too deep to indent in the template's stack: one line
            return json.dumps(value, ensure_ascii=False, cls=self.encoder)

    # json.loads raises RecursionError, not a decode error, past Python's
    # nesting limit: a form error, not a server error.
    def to_python(self, value):
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError(_TOO_DEEP, code="invalid") from None

    def bound_data(self, data, initial):
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

    def clean_payload(self):
        payload = self.cleaned_data["payload"]
        try:
            check_payload(payload)  # what enqueue() refuses (NaN, lone surrogates, ...)
        except InvalidMessage as exc:
            raise forms.ValidationError(str(exc)) from None
        return payload

    def clean(self):
        data = super().clean()
        if self.instance.state != DeadLetterState.NEW:
            raise forms.ValidationError(
                f"This dead letter is {self.instance.state}: only a new one's payload can change."
            )
        return data
