"""Property-based tests (Hypothesis) of bad input: every value given to
enqueue(), enqueue_many() or the admin's payload form ends either stored and
read back equal (as the worker hands it to a handler), or refused with a
clear error and nothing written.

The poison a worker meets (rows written by raw SQL, handlers that return
garbage, block or kill their thread) is in test_poison.py.
"""

import html
import json
import math
import tempfile

import pytest
from demo.models import Handled
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from django_pgqueue import InvalidMessage, enqueue, enqueue_many
from django_pgqueue.admin.forms import DeadLetterPayloadForm
from django_pgqueue.models import DeadLetter, Message
from django_pgqueue.notify import CHANNEL
from django_pgqueue.worker import Worker

from .claiming import claim

# Deterministic in CI (derandomize: the examples follow from the test's code),
# and nothing written to a .hypothesis directory: no example database, and
# Hypothesis's caches (Unicode tables, constants) go to a temporary directory.
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="pgqueue-hypothesis-"))
settings.register_profile(
    "pgqueue-fuzz",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=60,
    print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FUZZ = settings.get_profile("pgqueue-fuzz")

QUEUE = "fuzz"

# --- strategies -------------------------------------------------------------------

# Strings from every Unicode category, lone surrogates (Cs) included, and the
# characters that break things most often.
NASTY = [
    "\x00",  # NUL: jsonb cannot store it
    "\ud800",  # lone high surrogate
    "\udfff",  # lone low surrogate
    "\U0001f600",  # emoji: a surrogate pair once escaped
    "\u202e",  # right-to-left override
    "\u05e9\u05dc\u05d5\u05dd",  # Hebrew, RTL
    "\u200f",  # right-to-left mark
    "\ufeff",  # byte order mark
    "\x1b[31m",  # terminal escape
    "\u0085\u2028\u2029",  # line separators JSON does not escape
    '\\u0000 "quoted" \\',  # text that looks like a JSON escape of NUL
]
texts = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=12),
    st.sampled_from(NASTY),
    st.lists(st.sampled_from(NASTY), min_size=1, max_size=3).map("".join),
)
numbers = st.one_of(
    st.integers(),
    st.floats(),  # NaN and the infinities included
    st.sampled_from([0.0, -0.0, 1e16, 1e308, 5e-324, 2**63, -(2**63) - 1, 10**40]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
keys = st.one_of(
    texts,
    texts,
    texts,
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, width=16),
)
json_like = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
    max_leaves=16,
)


def deeply_nested(depth):
    value = []
    for _ in range(depth):
        value = [value]
    return value


# --- the oracle -------------------------------------------------------------------


def problem_of(value):
    """Why enqueue() must refuse ``value`` as a payload, or None if it must
    store it (checked independently of the library's own code)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return "not JSON-serializable"
        if isinstance(item, str):
            if "\x00" in item:
                return "NUL character"
            if any(0xD800 <= ord(c) <= 0xDFFF for c in item):
                return "lone surrogate"
        elif isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return "dict key that is not a string"
            pending += [*item, *item.values()]
        elif isinstance(item, list):
            pending += item
    return None


def same(stored, given):
    """Whether ``stored`` (read back from jsonb) equals ``given``. jsonb keeps
    numbers as numeric: a float may come back as the int of the same value
    (1e16 as 10000000000000000), so numbers compare by value."""
    if isinstance(given, bool) or isinstance(stored, bool):
        return type(stored) is type(given) and stored == given
    if isinstance(given, float) or isinstance(stored, float):
        return isinstance(stored, int | float) and float(stored) == float(given)
    if isinstance(given, dict):
        return (
            isinstance(stored, dict)
            and stored.keys() == given.keys()
            and all(same(stored[k], given[k]) for k in given)
        )
    if isinstance(given, list):
        return (
            isinstance(stored, list)
            and len(stored) == len(given)
            and all(same(s, g) for s, g in zip(stored, given, strict=True))
        )
    if isinstance(given, str):  # the form's JSONString is a str subclass
        return isinstance(stored, str) and str(stored) == str(given)
    return type(stored) is type(given) and stored == given


def received(message):
    """``message`` as a handler receives it: claimed, built from the claim's row."""
    (claimed,) = claim([QUEUE], 1, "fuzz-worker", 60)
    assert claimed.pk == message.pk, "the claim took another message"
    return claimed


# --- enqueue ------------------------------------------------------------------------


@pytest.mark.django_db
@FUZZ
@given(payload=json_like, headers=st.dictionaries(texts, json_like, max_size=3))
def test_enqueue_stores_what_it_is_given_or_refuses_it_and_writes_nothing(payload, headers):
    before = Message.objects.count()
    problem = problem_of(payload) or problem_of(headers)
    if problem:
        with pytest.raises(InvalidMessage, match="payload|headers"):
            enqueue("fuzz.topic", payload, headers=headers, queue=QUEUE)
        assert Message.objects.count() == before, "a refused message was written"
        return
    message = enqueue("fuzz.topic", payload, headers=headers, queue=QUEUE)
    got = received(message)
    assert same(got.payload, payload), f"payload {payload!r} came back as {got.payload!r}"
    assert same(got.headers, headers), f"headers {headers!r} came back as {got.headers!r}"


@pytest.mark.django_db
@settings(FUZZ, max_examples=30)
@given(payloads=st.lists(json_like, min_size=1, max_size=6))
def test_enqueue_many_stores_every_message_or_none(payloads):
    before = Message.objects.count()
    bad = [i for i, payload in enumerate(payloads) if problem_of(payload)]
    items = [{"payload": payload} for payload in payloads]
    if bad:
        with pytest.raises(InvalidMessage, match=rf"^message {bad[0]}: payload "):
            enqueue_many(items, topic="fuzz.topic", queue=QUEUE)
        assert Message.objects.count() == before, "part of a refused batch was written"
        return
    messages = enqueue_many(items, topic="fuzz.topic", queue=QUEUE)
    stored = dict(
        Message.objects.filter(pk__in=[m.pk for m in messages]).values_list("pk", "payload")
    )
    for message, payload in zip(messages, payloads, strict=True):
        assert same(stored[message.pk], payload), f"{payload!r} came back as {stored[message.pk]!r}"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({1: "a", "1": "b"}, "dict key that is not a string: 1 .int."),
        ({"a": {None: 1}}, "dict key that is not a string: None"),
        ([{"k": "\ud83d"}], "lone surrogate"),
        ("\udc00 alone", "lone surrogate"),
        ({"k\x00": 1}, "NUL character"),
        ({"x": [math.inf]}, "not JSON-serializable"),
        (deeply_nested(10_000), "nested too deeply"),
    ],
)
def test_enqueue_names_the_problem(payload, words):
    with pytest.raises(InvalidMessage, match=words):
        enqueue("fuzz.topic", payload)
    with pytest.raises(InvalidMessage, match=f"message 0: payload .*{words}"):
        enqueue_many([{"payload": payload}], topic="fuzz.topic")
    assert not Message.objects.exists()


@pytest.mark.django_db
def test_a_value_nested_as_deep_as_the_encoder_allows_round_trips():
    payload = deeply_nested(200)
    message = enqueue("fuzz.topic", payload, queue=QUEUE)
    assert received(message).payload == payload


@pytest.mark.django_db
def test_a_refused_enqueue_leaves_the_callers_transaction_usable():
    with transaction.atomic():
        kept = enqueue("fuzz.topic", {"n": 1})
        with pytest.raises(InvalidMessage):
            enqueue("fuzz.topic", {"s": "\ud800"})
        with pytest.raises(InvalidMessage):
            enqueue("fuzz.topic", {2: "two"})
        after = enqueue("fuzz.topic", {"n": 2})
    assert list(Message.objects.order_by("pk").values_list("pk", flat=True)) == [kept.pk, after.pk]


# --- a payload past NOTIFY's 8000 bytes -------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_payload_past_the_notify_limit_still_wakes_a_listener_and_is_handled(listener):
    payload = {"blob": "\u00e9\U0001f600" * 50_000, "n": list(range(1000))}  # ~300 kB
    message = enqueue("test.record", payload)
    assert listener.wait_for(1) == [(CHANNEL, "default")], "no wake-up, or it carried more"
    assert Worker(concurrency=1, burst=True).run() == 1
    assert Handled.objects.filter(message_id=message.pk).exists(), "the large message was lost"
    assert not Message.objects.exists()


# --- the admin's payload form -----------------------------------------------------------


def submit_payload(dead_letter, text):
    """Submit ``text`` as the dead letter's payload the way the admin does
    (DeadLetterAdmin.save_model: an UPDATE guarded by the state). Returns the
    form; the form and its re-rendering must never raise."""
    form = DeadLetterPayloadForm(data={"payload": text}, instance=dead_letter)
    if form.is_valid():
        with transaction.atomic():
            DeadLetter.objects.filter(pk=dead_letter.pk, state="new").update(
                payload=form.cleaned_data["payload"]
            )
    else:
        assert form.errors["payload"], f"{text[:80]!r} was refused without a payload error"
    str(form["payload"])  # the page shows the field again: rendering must not raise
    return form


@pytest.mark.django_db
@settings(FUZZ, max_examples=80)
@given(
    value=json_like,
    encode=st.sampled_from(["ascii", "unicode", "garbage"]),
    garbage=st.text(st.characters(exclude_categories=()), max_size=30),
)
def test_the_payload_form_stores_what_it_accepts_and_refuses_the_rest(
    make_dead_letter, value, encode, garbage
):
    dead = make_dead_letter(payload={"before": True})
    if encode == "garbage":
        text = garbage
    else:
        try:
            text = json.dumps(value, ensure_ascii=encode == "ascii")  # NaN as "NaN"
        except (TypeError, ValueError):  # mixed key types that cannot be sorted, ...
            text = garbage
    form = submit_payload(dead, text)
    stored = DeadLetter.objects.get(pk=dead.pk).payload
    if form.is_valid():
        assert same(stored, form.cleaned_data["payload"]), f"{text!r} was stored as {stored!r}"
        parsed = form.cleaned_data["payload"]
        assert problem_of(parsed) is None and parsed is not None
    else:
        assert stored == {"before": True}, "a refused payload was written"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 10_000 + "]" * 10_000, "nested too deeply"),
        ('{"x": NaN}', "not JSON-serializable"),
        ('{"x": -Infinity}', "not JSON-serializable"),
        ('{"x": "\\ud800"}', "lone surrogate"),
        ('{"x": "\\u0000"}', "NUL character"),
        ("null", "required"),
        ('{"unclosed": ', "valid JSON"),
    ],
)
def test_the_payload_form_explains_what_it_refuses(make_dead_letter, text, words):
    dead = make_dead_letter(payload={"before": True})
    form = submit_payload(dead, text)
    assert not form.is_valid()
    assert words in " ".join(form.errors["payload"]), form.errors
    assert DeadLetter.objects.get(pk=dead.pk).payload == {"before": True}


@pytest.mark.django_db
def test_the_payload_form_shows_a_payload_too_deep_to_indent(make_dead_letter):
    payload = deeply_nested(900)
    with connection.cursor() as cursor:  # as a raw SQL client could have stored it
        cursor.execute(
            "INSERT INTO django_pgqueue_deadletter (message_id, queue, topic, payload, "
            "category, reason) VALUES (1, 'default', 't', %s::jsonb, 'unknown', 'r') RETURNING id",
            [json.dumps(payload)],
        )
        pk = cursor.fetchone()[0]
    form = DeadLetterPayloadForm(instance=DeadLetter.objects.get(pk=pk))
    shown = html.unescape(str(form["payload"]).split(">", 1)[1].rsplit("<", 1)[0])
    assert json.loads(shown) == payload, "the form does not show the stored payload"
