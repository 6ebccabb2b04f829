"""The app's own admin pages look like Django's around them."""

import re

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

BREADCRUMBS = re.compile(r'<(ol|div) class="breadcrumbs">')


def test_our_pages_draw_breadcrumbs_as_the_installed_admin_does(admin_client):
    """Django's admin drew breadcrumbs as a <div> up to 5.2 and as an <ol>
    since, and styles only its own markup: our pages must use the same
    element as Django's own pages, or their breadcrumbs show unstyled."""
    django_page = admin_client.get(
        reverse("admin:django_pgqueue_deadletter_changelist")
    ).content.decode()
    ours = admin_client.get(reverse("admin:django_pgqueue_deadletter_summary")).content.decode()
    django_element = BREADCRUMBS.search(django_page)
    our_element = BREADCRUMBS.search(ours)
    assert django_element is not None and our_element is not None
    assert our_element.group(1) == django_element.group(1)
    assert "Home" in ours[our_element.start() : our_element.start() + 600]
