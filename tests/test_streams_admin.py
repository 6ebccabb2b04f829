"""Streams in the admin and the metrics: subscriptions with their
checkpoint, lag and state; the pause, resume, reset and dead-letter actions
with their permissions, intermediate pages and form errors; the read-only
stream events; the lag and state in the Prometheus metrics."""

import pytest
from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from django_pgqueue import publish
from django_pgqueue.models import DeadLetter, StreamEvent, Subscription, SubscriptionState
from django_pgqueue.observability import scrape
from django_pgqueue.streams import subscriptions

pytestmark = pytest.mark.django_db(transaction=True)

SUBSCRIPTIONS = reverse("admin:django_pgqueue_subscription_changelist")
EVENTS = reverse("admin:django_pgqueue_streamevent_changelist")
XSS = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


@pytest.fixture
def events():
    """Five committed events of test.events, and their positions."""
    return [publish("test.events", {"n": n}, key=f"k{n}") for n in range(5)]


def make(name, events=(), after=None, **fields):
    """A subscription of test.events whose checkpoint is after ``after`` (an index)."""
    if after is not None:
        fields.update(checkpoint_xid=events[after].xid, checkpoint_position=events[after].position)
    return Subscription.objects.create(name=name, stream="test.events", **fields)


def reread(subscription):
    return Subscription.objects.get(pk=subscription.pk)


def action(client, name, objs, **data):
    post = {"action": name, "index": 0, helpers.ACTION_CHECKBOX_NAME: [o.pk for o in objs]}
    return client.post(SUBSCRIPTIONS, {**post, **data})


def apply(client, name, objs, **data):
    post = {"action": name, "apply": "yes", helpers.ACTION_CHECKBOX_NAME: [o.pk for o in objs]}
    return client.post(SUBSCRIPTIONS, {**post, **data}, follow=True)


def actions(response):
    """The names of the actions a changelist offers."""
    form = response.context["action_form"]
    return set() if form is None else {name for name, _ in form.fields["action"].choices if name}


def texts(response):
    return [str(m) for m in response.context["messages"]]


def logged(obj):
    return [
        entry.change_message
        for entry in LogEntry.objects.filter(object_id=str(obj.pk), action_flag=CHANGE)
    ]


@pytest.fixture
def staff(client):
    """Log in a staff user with the given permissions (codenames)."""

    def login(*codenames):
        user = User.objects.create_user(
            f"operator{User.objects.count()}", password="x", is_staff=True
        )
        user.user_permissions.set(
            Permission.objects.filter(
                content_type__app_label="django_pgqueue", codename__in=codenames
            )
        )
        client.force_login(user)
        return client

    return login


def test_the_list_shows_state_checkpoint_head_and_lag(admin_client, events):
    behind = make("test.ledger", events, after=1)
    blocked = make(
        "old.blocked",
        events,
        after=0,
        state=SubscriptionState.BLOCKED,
        attempts=3,
        failing_position=events[1].position,
        last_error=f"RuntimeError: {XSS}\nTraceback...",
    )
    response = admin_client.get(SUBSCRIPTIONS)
    assert response.status_code == 200
    rows = {row.name: row for row in response.context["cl"].result_list}
    assert set(rows) == {behind.name, blocked.name}
    assert (rows["test.ledger"].lag, rows["old.blocked"].lag) == (3, 4)
    assert rows["test.ledger"].head_position == events[-1].position
    assert (
        rows["test.ledger"].oldest_pending_at
        == StreamEvent.objects.get(pk=events[2].position).created_at
    )
    page = response.content.decode()
    assert XSS not in page and ESCAPED in page and "Traceback" not in page
    assert "Blocked" in page and "Active" in page
    filtered = admin_client.get(SUBSCRIPTIONS, {"state__exact": "blocked"})
    assert [row.name for row in filtered.context["cl"].result_list] == ["old.blocked"]


def test_a_subscription_is_read_only_and_only_an_unregistered_one_can_be_deleted(
    admin_client, events
):
    registered = make("test.ledger")
    stale = make("old.gone")
    url = reverse("admin:django_pgqueue_subscription_change", args=[registered.pk])
    response = admin_client.get(url)
    assert response.status_code == 200 and 'name="_save"' not in response.content.decode()
    assert admin_client.post(url, {"name": "x"}).status_code == 403
    assert admin_client.get(reverse("admin:django_pgqueue_subscription_add")).status_code == 403
    delete = "admin:django_pgqueue_subscription_delete"
    assert (
        admin_client.post(reverse(delete, args=[registered.pk]), {"post": "yes"}).status_code == 403
    )
    assert admin_client.post(reverse(delete, args=[stale.pk]), {"post": "yes"}).status_code == 302
    assert list(Subscription.objects.values_list("name", flat=True)) == ["test.ledger"]
    assert actions(admin_client.get(SUBSCRIPTIONS)) == {
        "pause", "resume", "reset_checkpoint", "dead_letter_blocked",
    }, "delete_selected would delete registered subscriptions too"  # fmt: skip


def test_pause_and_resume_need_their_permission(staff, events):
    subscription = make("test.ledger")
    viewer = staff("view_subscription")
    assert actions(viewer.get(SUBSCRIPTIONS)) == set()
    action(viewer, "pause", [subscription])
    assert reread(subscription).state == SubscriptionState.ACTIVE, "paused without permission"
    viewer.logout()

    operator = staff("view_subscription", "pause_subscription")
    assert actions(operator.get(SUBSCRIPTIONS)) == {"pause", "resume"}
    response = operator.post(
        SUBSCRIPTIONS,
        {"action": "pause", "index": 0, helpers.ACTION_CHECKBOX_NAME: [subscription.pk]},
        follow=True,
    )
    assert texts(response) == ["Paused 1 of 1 selected subscription(s)."]
    assert reread(subscription).state == SubscriptionState.PAUSED
    assert logged(subscription) == ["Paused (admin action)"]
    action(operator, "resume", [subscription])
    assert reread(subscription).state == SubscriptionState.ACTIVE


def test_reset_asks_for_a_position_and_explains_what_is_wrong(staff, events):
    subscription = make(
        "test.ledger",
        events,
        after=0,
        state=SubscriptionState.BLOCKED,
        attempts=5,
        failing_position=events[1].position,
        last_error="RuntimeError",
    )
    client = staff("view_subscription", "reset_subscription")
    page = action(client, "reset_checkpoint", [subscription])
    assert page.status_code == 200 and page.templates[0].name.endswith("action_form.html")
    assert page.context["form"].initial["position"] == events[1].position, "the blocked event"
    assert "test.ledger at position" in page.content.decode()

    first, last = events[0].position, events[-1].position
    for position, error in [
        ("abc", "Give the position as a whole number, such as 1042."),
        ("-1", "A position is 0 (the beginning) or more."),
        ("", "Give the position to go on after."),
        (
            str(last + 100),
            f"Stream &#x27;test.events&#x27; has no event at position {last + 100} "
            f"(it holds positions {first} to {last}).",
        ),
    ]:
        response = apply(client, "reset_checkpoint", [subscription], target="position",
                         position=position)  # fmt: skip
        assert error in response.content.decode(), f"{position!r}: {error!r} not shown"
        assert reread(subscription).checkpoint_position == events[0].position

    response = apply(
        client, "reset_checkpoint", [subscription], target="position", position=events[2].position
    )
    assert texts(response) == ["Reset 1 of 1 selected subscription(s)."]
    changed = reread(subscription)
    assert (changed.checkpoint_position, changed.checkpoint_xid) == (
        events[2].position, events[2].xid,
    )  # fmt: skip
    assert (changed.state, changed.attempts, changed.failing_position) == ("active", 0, None)
    assert logged(subscription) == [f"Checkpoint reset to {events[2].position} (admin action)"]

    apply(client, "reset_checkpoint", [subscription], target="beginning")
    assert reread(subscription).checkpoint_position == 0
    wait_for_head(last)
    apply(client, "reset_checkpoint", [subscription], target="end")
    assert reread(subscription).checkpoint_position == last


def wait_for_head(position):
    from .conftest import wait_until
    from .test_streams import HORIZON_TIMEOUT

    wait_until(
        lambda: subscriptions.head("test.events")[1] == position,
        timeout=HORIZON_TIMEOUT,  # every older transaction of the cluster must end
        message="settled events",
    )


def test_the_blocked_event_can_be_moved_to_the_dead_letters(staff, events):
    blocked = make(
        "test.ledger",
        events,
        after=0,
        state=SubscriptionState.BLOCKED,
        attempts=5,
        failing_position=events[1].position,
        last_error="RuntimeError: boom",
    )
    active = make("old.active")
    client = staff("view_subscription", "reset_subscription")
    page = action(client, "dead_letter_blocked", [blocked, active])
    assert "1 of the 2 selected subscription(s) are blocked" in page.content.decode()
    response = apply(client, "dead_letter_blocked", [blocked, active], category="business")
    assert texts(response) == ["Moved the blocked event of 1 of 2 selected subscription(s)."]
    dead = DeadLetter.objects.get()
    assert (dead.topic, dead.message_id, dead.category, dead.attempts) == (
        "test.events", events[1].position, "business", 5,
    )  # fmt: skip
    assert dead.reason.startswith("RuntimeError: boom\n(moved to the dead letters by operator0)")
    assert dead.headers["pgqueue_subscription"] == "test.ledger"
    moved = reread(blocked)
    assert (moved.state, moved.checkpoint_position) == ("active", events[1].position)
    assert reread(active).checkpoint_position == 0


def test_stream_events_are_shown_escaped_and_read_only(admin_client):
    event = publish("test.events", {"html": XSS}, key="order-1", headers={"trace": XSS})
    response = admin_client.get(EVENTS, {"q": "order-1"})
    assert [row.pk for row in response.context["cl"].result_list] == [event.position]
    url = reverse("admin:django_pgqueue_streamevent_change", args=[event.position])
    page = admin_client.get(url).content.decode()
    assert XSS not in page and page.count(ESCAPED) == 2
    assert admin_client.post(url, {}).status_code == 403
    assert admin_client.get(reverse("admin:django_pgqueue_streamevent_add")).status_code == 403


def test_the_metrics_report_each_subscriptions_lag_and_state(events):
    make("test.ledger", events, after=1)
    make("old.paused", state=SubscriptionState.PAUSED)
    body, _ = scrape.render_database_metrics()
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def value(name, **labels):  # every sample says its database
        return samples.get((name, tuple(sorted({"database": "default", **labels}.items()))))

    ledger = {"subscription": "test.ledger", "stream": "test.events"}
    paused = {"subscription": "old.paused", "stream": "test.events"}
    assert value("pgqueue_subscription_lag_events", **ledger) == 3
    assert value("pgqueue_subscription_lag_events", **paused) == 5
    assert value("pgqueue_subscription_lag_seconds", **ledger) >= 0
    assert value("pgqueue_subscription_state", **ledger, state="active") == 1
    assert value("pgqueue_subscription_state", **ledger, state="blocked") == 0
    assert value("pgqueue_subscription_state", **paused, state="paused") == 1
    subscriptions.reset(["test.ledger"], events[-1].position)
    body, _ = scrape.render_database_metrics()
    assert (
        'pgqueue_subscription_lag_seconds{database="default",stream="test.events",'
        'subscription="test.ledger"} 0.0' in (body.decode())
    )
