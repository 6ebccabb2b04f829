"""The models reference: every model of the app with its fields, read from
the model's ``_meta`` (type, null, default, choices) and its source (the
comment above a field, or its ``help_text``)."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from pgqueue_docs.source import Comments, heading, rst_text


def _describe(field: Any, comments: Comments, lines: dict[str, int]) -> str:
    parts = []
    if field.help_text:
        parts.append(str(field.help_text))
    if field.name in lines:
        parts += comments.above(lines[field.name])
    if field.choices:
        parts.append("One of " + ", ".join(f"``{value}``" for value, _ in field.choices) + ".")
    return " ".join(rst_text(p) if not p.startswith("One of ``") else p for p in parts)


def _type(field: Any) -> str:
    if field.is_relation and field.related_model is not None:
        kind = f"{type(field).__name__} to ``{field.related_model.__name__}``"
    else:
        kind = type(field).__name__
    return kind + (", null" if field.null else "")


def models_rst() -> list[str]:
    from django.apps import apps

    lines: list[str] = []
    for model in apps.get_app_config("django_pgqueue").get_models():
        source_file = inspect.getsourcefile(model)
        source = open(source_file, encoding="utf-8").read()  # noqa: SIM115
        comments = Comments.of(source)
        field_lines: dict[str, int] = {}
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.name == model.__name__:
                for statement in node.body:
                    if isinstance(statement, ast.Assign | ast.AnnAssign):
                        target = (
                            statement.targets[0]
                            if isinstance(statement, ast.Assign)
                            else statement.target
                        )
                        if isinstance(target, ast.Name):
                            field_lines[target.id] = statement.lineno
        path = f"django_pgqueue.models.{model.__name__}"
        lines += heading(f"``{model.__name__}``", "=")
        doc = inspect.getdoc(model) or ""
        if doc and not doc.startswith(f"{model.__name__}("):  # Django's default docstring
            lines += [
                line for p in doc.split("\n\n") for line in (rst_text(" ".join(p.split())), "")
            ]
        lines += [
            f"``{path}``, table ``{model._meta.db_table}``.",
            "",
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 20 25 55",
            "",
            "   * - Field",
            "     - Type",
            "     - Description",
        ]
        for field in model._meta.concrete_fields:
            lines += [
                f"   * - ``{field.name}``",
                f"     - {_type(field)}",
                f"     - {_describe(field, comments, field_lines) or ''}".rstrip(),
            ]
        lines.append("")
    return lines
