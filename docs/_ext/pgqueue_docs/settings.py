"""The settings reference: ``DEFAULTS`` of ``conf/defaults.py`` with the
comment above each key, and what the key's check in ``conf/problems.py``
says about a wrong value.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pgqueue_docs.source import (
    Comments,
    Messages,
    heading,
    indent,
    rst_text,
    source_of,
)


@dataclass
class Setting:
    key: str
    default: Any
    default_source: str
    description: list[str]  # paragraphs, shared by the keys of a group
    note: str  # the comment on the key's own line(s)
    group: str  # the first key of its group
    problems: list[str] = field(default_factory=list)


def settings() -> list[Setting]:
    """Every ``DEFAULTS`` key, in source order. A comment block describes
    the key below it and the keys on the lines right after (a group, as
    BACKOFF_BASE, BACKOFF_CAP, BACKOFF_JITTER); a blank line ends a group."""
    from django_pgqueue.conf import defaults, problems

    source, path = source_of(defaults)
    comments = Comments.of(source)
    tree = ast.parse(source)
    entries: list[tuple[str, ast.expr, ast.expr]] = []
    for node in tree.body:
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
            )
        )
        if isinstance(target, ast.Name) and target.id == "DEFAULTS":
            assert isinstance(node.value, ast.Dict), "DEFAULTS must be a dict display"
            for key, value in zip(node.value.keys, node.value.values, strict=True):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    raise ValueError(
                        f"{path}:{value.lineno}: DEFAULTS entries must be 'KEY': value "
                        "pairs with a comment above (the settings reference reads them)"
                    )
                entries.append((key.value, key, value))
    missing = set(defaults.DEFAULTS) - {key for key, _, _ in entries}
    if missing:
        raise ValueError(f"{path}: DEFAULTS keys not written in its dict display: {missing}")

    messages = Messages(problems)
    found: list[Setting] = []
    previous_end = -1
    for key, key_node, value_node in entries:
        description = comments.above(key_node.lineno)
        group = key
        if not description and found and previous_end == key_node.lineno - 1:
            description, group = found[-1].description, found[-1].group
        check = problems.CHECKS.get(key)
        found.append(
            Setting(
                key=key,
                default=defaults.DEFAULTS[key],
                default_source=ast.get_source_segment(source, value_node) or "",
                description=description,
                note=comments.within(key_node.lineno, value_node.end_lineno),
                group=group,
                problems=_check_messages(messages, check) if check else [],
            )
        )
        previous_end = value_node.end_lineno
    return found


def _check_messages(messages: Messages, check: Callable[[Any], Any]) -> list[str]:
    if getattr(check, "__module__", None) != messages.module.__name__:
        return []
    return messages.returned(check.__name__)


def _default_text(setting: Setting) -> str:
    """The default as written, and its value when that is computed
    (``7 * 24 * 3600.0``)."""
    try:
        literal = ast.literal_eval(setting.default_source) == setting.default
    except ValueError:
        literal = False
    if literal or not setting.default_source:
        return f"``{setting.default_source or repr(setting.default)}``"
    return f"``{setting.default_source}`` (``{setting.default!r}``)"


def settings_rst() -> list[str]:
    items = settings()
    lines = [".. list-table::", "   :header-rows: 1", "   :widths: 40 60", ""]
    lines += ["   * - Setting", "     - Default"]
    for s in items:
        lines += [f"   * - :setting:`{s.key}`", f"     - {_default_text(s)}"]
    lines.append("")
    groups: dict[str, list[Setting]] = {}
    for s in items:
        groups.setdefault(s.group, []).append(s)
    for members in groups.values():
        lines += [f".. setting:: {s.key}" for s in members] + [""]
        lines += heading(", ".join(f"``{s.key}``" for s in members), "=")
        for paragraph in members[0].description:
            lines += [rst_text(paragraph, own=members[0].key), ""]
        for s in members:
            fields = [f":Default: {_default_text(s)}"]
            if s.note:
                fields.append(f":Note: {rst_text(s.note, own=s.key)}")
            if len(s.problems) == 1:
                fields.append(f":Check: {rst_text(s.problems[0], own=s.key)}")
            elif s.problems:
                fields += [":Check:", ""]
                fields += [f"   - {rst_text(p, own=s.key)}" for p in s.problems]
                fields.append("")
            if len(members) > 1:
                lines += [f"``{s.key}``", *indent(fields), ""]
            else:
                lines += [*fields, ""]
    return lines
