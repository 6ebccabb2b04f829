"""The Python API reference: autodoc directives for the public map
(``django_pgqueue._API``), the Tasks backend's, and the signals with where
each is sent.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

from pgqueue_docs.source import (
    Comments,
    heading,
    indent,
    package_modules,
    rst_text,
    source_of,
)

# Titles for the names of the public map that no comment groups.
API_TITLES = {
    "django_pgqueue.enqueuing": "Enqueueing",
    "django_pgqueue.enqueuing_async": "Enqueueing",
    "django_pgqueue.registry": "Handlers",
    "django_pgqueue.deadletters": "Dead letters",
}


def api_groups() -> dict[str, list[str]]:
    """The names of ``django_pgqueue._API`` by section, in the map's order:
    a comment above an entry (``# streams (the transactional outbox)``)
    starts a section that the entries right after it share; the others go
    by their module (``API_TITLES``); exceptions go last, together."""
    import django_pgqueue

    source, path = source_of(django_pgqueue)
    comments = Comments.of(source)
    mapping = next(
        node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        and getattr(node.targets[0] if isinstance(node, ast.Assign) else node.target, "id", "")
        == "_API"
    )
    assert isinstance(mapping, ast.Dict), f"{path}: _API must be a dict display"
    groups: dict[str, list[str]] = {}
    exceptions: list[str] = []
    title, previous_end = None, -1
    for key_node, value_node in zip(mapping.keys, mapping.values, strict=True):
        name, module = ast.literal_eval(key_node), ast.literal_eval(value_node)
        above = comments.above(key_node.lineno)
        if above:
            title = above[0][0].upper() + above[0][1:]
        elif previous_end != key_node.lineno - 1:
            title = None
        previous_end = value_node.end_lineno
        obj = getattr(django_pgqueue, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            exceptions.append(name)
            continue
        section = title or API_TITLES.get(module) or module.rsplit(".", 1)[-1].capitalize()
        groups.setdefault(section, []).append(name)
    missing = set(django_pgqueue._API) - {n for names in groups.values() for n in names}
    assert not missing - set(exceptions), f"{path}: _API entries not read: {missing}"
    return {**groups, "Exceptions": exceptions}


def api_rst() -> list[str]:
    """autodoc directives for every name of the public map, by section."""
    import django_pgqueue

    lines = []
    for title, names in api_groups().items():
        lines += heading(rst_text(title, link_settings=False), "=")
        for name in names:
            obj = getattr(django_pgqueue, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                lines += [f".. autoexception:: django_pgqueue.{name}", "   :show-inheritance:", ""]
            elif inspect.isclass(obj):
                lines += [f".. autoclass:: django_pgqueue.{name}", "   :members:", ""]
            else:
                lines += [f".. autofunction:: django_pgqueue.{name}", ""]
    return lines


TASKS_BACKEND = [
    ".. automodule:: django_pgqueue.tasks",
    "   :no-members:",
    "",
    ".. autoclass:: django_pgqueue.tasks.PgQueueBackend",
    "   :members: enqueue, get_result",
    "",
    ".. autoclass:: django_pgqueue.tasks.PgQueueTask",
    "",
]


def tasks_rst() -> list[str]:
    """The Tasks backend's autodoc; ``django.tasks`` (which it imports) is
    Django 6.0+, so a build on Django 5.2 says where to read it instead."""
    import django

    if django.VERSION >= (6, 0):
        return TASKS_BACKEND
    return [
        ".. note::",
        "",
        f"   These pages were built on Django {django.get_version()}, which has no "
        "``django.tasks``: the backend's reference is in the documentation built on "
        "Django 6 (``tox -e docs``, the published site).",
        "",
    ]


# --- signals ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignalSend:
    signal: str
    sender: str
    arguments: tuple[str, ...]
    module: str


def signal_names() -> list[str]:
    """The signals of ``signals.py``, in source order."""
    from django.dispatch import Signal

    from django_pgqueue import signals

    source, _ = source_of(signals)
    return [
        node.targets[0].id
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign)
        and isinstance(node.targets[0], ast.Name)
        and isinstance(getattr(signals, node.targets[0].id, None), Signal)
    ]


def signal_sends() -> list[SignalSend]:
    """Where the package sends each of its signals, with the sender and the
    keyword arguments, read from the calls: ``send(signal, sender=...,
    **kwargs)`` and ``signal.send(...)``, also through ``functools.partial``,
    and the ``(signal, {"sender": ..., ...})`` pairs a batch sends at its
    commit."""
    ours = set(signal_names())

    def named(node: ast.AST) -> str | None:
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
        return name if name in ours else None

    found: list[SignalSend] = []
    for module, path in package_modules():
        if module == "django_pgqueue.signals":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                parts = [node.func, *node.args]
                sends = any(
                    (p.attr if isinstance(p, ast.Attribute) else getattr(p, "id", ""))
                    in ("send", "send_robust")
                    for p in parts
                )
                if isinstance(node.func, ast.Attribute) and named(node.func.value):
                    signal, rest = named(node.func.value), node.args
                else:
                    at = next((i for i, a in enumerate(node.args) if named(a)), None)
                    signal = named(node.args[at]) if at is not None else None
                    rest = node.args[at + 1 :] if at is not None else []
                if not (sends and signal):
                    continue
                keywords = {k.arg: k.value for k in node.keywords if k.arg}
                sender = keywords.pop("sender", rest[0] if rest else None)
            elif (
                isinstance(node, ast.Tuple)
                and len(node.elts) == 2
                and named(node.elts[0])
                and isinstance(node.elts[1], ast.Dict)
            ):
                signal = named(node.elts[0])
                keywords = {
                    k.value: v
                    for k, v in zip(node.elts[1].keys, node.elts[1].values, strict=True)
                    if isinstance(k, ast.Constant)
                }
                sender = keywords.pop("sender", None)
            else:
                continue
            send = SignalSend(
                signal=signal,
                sender=ast.unparse(sender) if sender is not None else "None",
                arguments=tuple(keywords),
                module=module,
            )
            if send not in found:
                found.append(send)
    return found


def signals_rst() -> list[str]:
    """Each ``Signal()`` of ``signals.py`` with the comment above it, and
    where it is sent from, with which sender and arguments."""
    from django_pgqueue import signals

    source, _ = source_of(signals)
    comments = Comments.of(source)
    sends = signal_sends()
    lines = []
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        if name not in signal_names():
            continue
        description = comments.above(node.lineno)
        # The name within its module (:module:), whatever module the page
        # made current: the signals page's automodule sets one already.
        lines += [f".. data:: {name}", "   :module: django_pgqueue.signals", ""]
        lines += indent([line for p in description for line in (rst_text(p), "")])
        sent = [s for s in sends if s.signal == name]
        if sent:
            lines += indent([":Sent:", ""])
        for s in sent:
            arguments = ", ".join(f"``{a}``" for a in s.arguments) or "none"
            lines += indent(
                [f"   - by ``{s.module}``, ``sender={s.sender}``, arguments {arguments}"]
            )
        lines.append("")
    return lines
