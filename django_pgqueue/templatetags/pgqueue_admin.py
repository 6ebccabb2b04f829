"""Template tags of the app's admin pages."""

from __future__ import annotations

import functools
from pathlib import Path

from django import template
from django.contrib import admin

register = template.Library()


@functools.cache
def _breadcrumbs_are_a_list() -> bool:
    # Django's admin drew breadcrumbs as a <div> with "›" between links up to
    # 5.2 and as an <ol> of <li> (the separator drawn by its CSS) since; its
    # stylesheet styles only its own markup. Our pages follow whichever the
    # installed admin uses, read from its own change form template rather
    # than guessed from a version number.
    change_form = Path(admin.__file__).parent / "templates" / "admin" / "change_form.html"
    return '<ol class="breadcrumbs">' in change_form.read_text(encoding="utf-8")


@register.simple_tag
def admin_breadcrumbs_are_a_list() -> bool:
    """True when the installed Django admin draws breadcrumbs as an ``<ol>``."""
    return _breadcrumbs_are_a_list()
