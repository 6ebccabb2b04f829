"""The system checks reference: every check id in the package's source, with
the message and hint of each check that carries it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from pgqueue_docs.problems import carrier_name, problems_reported
from pgqueue_docs.source import (
    Messages,
    enclosing_function,
    heading,
    package_modules,
    rst_text,
)

CHECK_ID_RE = re.compile(r"\bpgqueue\.[A-Z]\d{3}\b")


@dataclass
class CheckMessage:
    id: str
    level: str  # Error, Warning
    messages: list[str]  # the forms the message takes
    hint: str
    where: str  # module


def check_ids_in_source() -> set[str]:
    """Every ``pgqueue.X###`` written anywhere in the package's code."""
    found = set()
    for _, path in package_modules():
        found |= set(CHECK_ID_RE.findall(path.read_text(encoding="utf-8")))
    return found


def check_messages() -> list[CheckMessage]:
    """Every check message the package makes: ``checks.Error``/``Warning``
    calls (``id=``) and ``(id, message, hint)`` tuples (``conf.validate``)."""
    found = []
    for name, path in package_modules():
        source = path.read_text(encoding="utf-8")
        if not CHECK_ID_RE.search(source):
            continue
        messages = Messages(name)
        for node in ast.walk(messages.tree):
            if isinstance(node, ast.Call):
                keywords = {k.arg: k.value for k in node.keywords}
                ident = keywords.get("id")
                if not (
                    isinstance(ident, ast.Constant) and CHECK_ID_RE.fullmatch(str(ident.value))
                ):
                    continue
                level = node.func.attr if isinstance(node.func, ast.Attribute) else "Error"
                message = node.args[0] if node.args else keywords.get("msg")
                hint = keywords.get("hint")
                parts = (ident.value, message, hint)
            elif (
                isinstance(node, ast.Tuple)
                and len(node.elts) == 3
                and isinstance(node.elts[0], ast.Constant)
                and CHECK_ID_RE.fullmatch(str(node.elts[0].value))
            ):
                level = "Error" if ".E" in node.elts[0].value else "Warning"
                parts = (node.elts[0].value, node.elts[1], node.elts[2])
            else:
                continue
            scope = enclosing_function(messages.tree, node)
            ident, message, hint = parts
            carrier = carrier_name(message, hint)
            if carrier is not None and isinstance(scope, ast.FunctionDef):
                # The message is a problem object's: one entry per problem.
                for problem in problems_reported(messages, scope):
                    known = {carrier: problem.stand_in()}
                    found.append(
                        CheckMessage(
                            id=ident,
                            level=level,
                            messages=messages.render(message, known, scope) if message else [],
                            hint=" / ".join(messages.render(hint, known, scope)) if hint else "",
                            where=name,
                        )
                    )
                continue
            found.append(
                CheckMessage(
                    id=ident,
                    level=level,
                    messages=messages.render(message, {}, scope) if message else [],
                    hint=" / ".join(messages.render(hint, {}, scope)) if hint else "",
                    where=name,
                )
            )
    return found


def checks_rst() -> list[str]:
    by_id: dict[str, list[CheckMessage]] = {}
    for message in check_messages():
        by_id.setdefault(message.id, []).append(message)
    lines = []
    for ident in sorted(check_ids_in_source(), key=lambda i: (i[8], int(i[9:]))):
        messages = by_id.get(ident, [])
        levels = sorted({m.level for m in messages}) or ["(mentioned only)"]
        lines += [f".. check:: {ident}", ""]
        lines += heading(f"``{ident}``", "=")
        where = sorted({m.where for m in messages})
        lines += [
            f":Level: {', '.join(levels)}",
            f":Raised by: {', '.join(f'``{w}``' for w in where) or '(no message found)'}",
            "",
        ]
        for message in messages:
            lines += [f"- {rst_text(text)}" for text in message.messages]
            if message.hint:
                lines += ["", f"  *Hint:* {rst_text(message.hint)}"]
            lines.append("")
    return lines
