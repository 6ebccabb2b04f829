"""The management commands reference, from each command's argparse parser."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re
from typing import Any

from pgqueue_docs.source import (
    PACKAGE,
    heading,
    indent,
    package_dir,
    prose_rst,
    rst_text,
)

# Django's options that every command takes: listed once, not per command.
COMMON_OPTIONS = frozenset(
    {"verbosity", "settings", "pythonpath", "traceback", "no_color", "force_color",
     "skip_checks", "version", "help"}
)  # fmt: skip


def commands() -> list[tuple[str, Any]]:
    """``(name, Command instance)`` of every command of the package."""
    from django.core.management import load_command_class

    commands_dir = package_dir() / "management" / "commands"
    names = sorted(m.name for m in pkgutil.iter_modules([str(commands_dir)]))
    return [(name, load_command_class(PACKAGE, name)) for name in names]


def _invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if not action.option_strings:
        return action.metavar or action.dest
    return formatter._format_action_invocation(action)


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    text = parser._get_formatter()._expand_help(action)
    text = text[0].upper() + text[1:]
    return text if text.endswith((".", ")")) else text + "."


def _parser_rst(program: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    lines = [f".. program:: {program}", ""]
    subcommands: list[tuple[str, str, argparse.ArgumentParser]] = []
    for group in parser._action_groups:
        shown = [a for a in group._group_actions if a.dest not in COMMON_OPTIONS]
        options = [a for a in shown if not isinstance(a, argparse._SubParsersAction)]
        for action in shown:
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help or "" for a in action._choices_actions}
                subcommands += [(n, helps.get(n, ""), p) for n, p in action.choices.items()]
        if not options:
            continue
        lines += [f".. rubric:: {group.title[0].upper()}{group.title[1:]}", ""]
        for action in options:
            lines += [f".. option:: {_invocation(parser, action)}", ""]
            body = [rst_text(_help(parser, action))] if action.help else []
            if action.choices and not isinstance(action.choices, dict):
                body.append("One of " + ", ".join(f"``{c}``" for c in action.choices) + ".")
            if action.required and action.option_strings:
                body.append("Required.")
            lines += indent([" ".join(body) or "(No help text.)"]) + [""]
    for name, help_text, subparser in subcommands:
        lines += heading(f"``{program} {name}``", "-" if level == 2 else "~")
        if help_text:
            lines += [rst_text(help_text[0].upper() + help_text[1:] + "."), ""]
        lines += _parser_rst(f"{program} {name}", subparser, level + 1)
    return lines


def commands_rst() -> list[str]:
    items = commands()
    common = []
    if items:
        name, command = items[0]
        parser = command.create_parser("manage.py", name)
        common = [
            f"``{_invocation(parser, a)}``"
            for a in parser._actions
            if a.dest in COMMON_OPTIONS and a.dest != "help"
        ]
    lines = [
        "Every command also takes Django's common options, not repeated below: "
        + ", ".join(common)
        + " (see Django's ``django-admin`` documentation), and ``-h``/``--help``.",
        "",
    ]
    for name, command in items:
        parser = command.create_parser("manage.py", name)
        lines += heading(f"``{name}``", "=")
        doc = inspect.getdoc(importlib.import_module(type(command).__module__)) or ""
        doc = re.sub(rf"^manage\.py {name}:\s*", "", doc)
        summary = command.help.rstrip(".")
        if not " ".join(doc.split()).lower().startswith(summary.lower()):
            lines += [rst_text(summary + "."), ""]
        lines += prose_rst(doc)
        lines += _parser_rst(name, parser, 2)
    return lines
