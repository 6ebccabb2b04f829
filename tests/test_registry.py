"""@handler registration, autodiscovery and duplicate detection."""

import pytest

from django_pgqueue import handler, registry
from django_pgqueue.exceptions import DuplicateHandler


@pytest.fixture
def clean_topic():
    yield "test.registry.topic"
    registry.unregister("test.registry.topic")


def test_autodiscovery_found_the_demo_apps_handlers():
    spec = registry.lookup("demo.welcome_email")
    assert spec is not None
    assert spec.atomic is True
    assert "demo.handlers.welcome_email" in spec.location
    assert registry.lookup("test.record_nonatomic").atomic is False
    assert registry.lookup("test.async").is_async is True
    assert registry.lookup("test.timeout").timeout == 1.0
    assert registry.lookup("nobody.handles") is None


def test_registration_keeps_the_function_and_its_options(clean_topic):
    @handler(clean_topic, max_attempts=3, timeout=2, atomic=False, backoff_base=0.5)
    def my_handler(message):
        return "ran"

    spec = registry.lookup(clean_topic)
    assert my_handler("m") == "ran", "the decorator returns the function itself"
    assert (spec.max_attempts, spec.timeout, spec.atomic, spec.backoff_base) == (3, 2.0, False, 0.5)
    assert spec.location.startswith("tests.test_registry.")
    assert "test_registry.py:" in spec.location


def test_a_second_handler_for_a_topic_names_both_locations(clean_topic):
    @handler(clean_topic)
    def first(message):
        pass

    with pytest.raises(DuplicateHandler) as raised:

        @handler(clean_topic)
        def second(message):
            pass

    text = str(raised.value)
    assert "two handlers for topic 'test.registry.topic'" in text
    assert ".first (" in text and ".second (" in text


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_attempts": 0}, "max_attempts must be at least 1"),
        ({"timeout": -1}, "timeout must be a positive number"),
        ({"timeout": "5"}, "timeout must be a positive number"),
        ({"atomic": "yes"}, "atomic must be True or False"),
        ({"backoff_cap": 0}, "backoff_cap must be a positive number"),
        ({"backoff_jitter": 1}, "backoff_jitter must be True, False or None"),
    ],
)
def test_bad_handler_options_are_rejected(clean_topic, kwargs, words):
    with pytest.raises(ValueError, match=words):
        handler(clean_topic, **kwargs)
    assert registry.lookup(clean_topic) is None


def test_bad_topic_is_rejected():
    with pytest.raises(ValueError, match="topic must not be empty"):
        handler("")
