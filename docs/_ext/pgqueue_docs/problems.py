"""The problems a check reports through an object that carries them.

A check whose message is made of ``x.problem`` and ``x.hint`` (pgqueue.E110
formats each ``InvalidSchedule`` that ``schedules.configured.load`` finds)
says nothing by itself: its real messages are the problem objects that the
code it calls builds. ``problems_reported`` finds them: every construction
of a class that takes a ``problem`` and a ``hint`` in the functions of the
package the check reaches, with the (problem, hint) pairs of the field
checks a construction unpacks (``InvalidSchedule(name, key, *pair) for pair
in check(...)``, the checks the values of a module's dict of field names).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pgqueue_docs.source import PLACEHOLDER, Messages, messages_of

# The parameters of a class whose objects carry a check's problem.
CARRIED = ("problem", "hint")


@dataclass(frozen=True)
class Problem:
    field: str | None  # None: the entry as a whole; PLACEHOLDER: known when it runs
    problem: str
    hint: str  # its forms joined with " / ", as the checks reference shows hints

    def stand_in(self) -> SimpleNamespace:
        """An object for the check's message: the problem's known attributes
        (any other, a name, stays ``…``)."""
        return SimpleNamespace(field=self.field, problem=self.problem, hint=self.hint)


def carrier_name(*nodes: ast.AST | None) -> str | None:
    """The name whose ``.problem`` or ``.hint`` the message is made of."""
    for node in nodes:
        for sub in ast.walk(node) if node is not None else ():
            if (
                isinstance(sub, ast.Attribute)
                and sub.attr in CARRIED
                and isinstance(sub.value, ast.Name)
            ):
                return sub.value.id
    return None


def problems_reported(messages: Messages, function: ast.FunctionDef) -> list[Problem]:
    """Every problem object that ``function`` or a function of the package
    it calls (transitively) builds."""
    found: list[Problem] = []
    seen: set[tuple[str, str]] = set()

    def visit(module: Messages, scope: ast.FunctionDef) -> None:
        if (module.module.__name__, scope.name) in seen:
            return
        seen.add((module.module.__name__, scope.name))
        calls = (node for node in ast.walk(scope) if isinstance(node, ast.Call))
        for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
            parameters = _carrier_parameters(module, node.func, scope)
            if parameters is not None:
                for problem in _built(module, scope, node, parameters):
                    if problem not in found:
                        found.append(problem)
                continue
            target = module.resolve(node.func, scope)
            if target is not None:
                visit(*target)

    visit(messages, function)
    return found


def _carrier_parameters(
    module: Messages, func: ast.expr, scope: ast.FunctionDef
) -> list[str] | None:
    """The parameter names of the class ``func`` names, if it carries a problem."""
    target = module.evaluate(func, module.imported_in(scope))
    if not inspect.isclass(target):
        return None
    try:
        parameters = list(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return None
    return parameters if all(name in parameters for name in CARRIED) else None


def _built(
    module: Messages, scope: ast.FunctionDef, call: ast.Call, parameters: list[str]
) -> list[Problem]:
    """The problems of one construction, under each way its function is called."""
    problems = []
    starred = [a for a in call.args if isinstance(a, ast.Starred)]
    for known in _call_sites(module, scope):
        if not starred:
            arguments = dict(zip(parameters, call.args, strict=False))
            arguments.update({k.arg: k.value for k in call.keywords if k.arg})
            field = _field(module, arguments.get("field"), known, scope)
            hint = " / ".join(module.render(arguments["hint"], known, scope))
            for text in module.render(arguments["problem"], known, scope):
                problems.append(Problem(field, text, hint))
            continue
        # InvalidSchedule(name, key, *pair) for pair in check(...): the pairs of
        # each field check (the values of the dict the loop takes them from).
        for key_name, checks in _field_checks(module, scope, call):
            for key, check in checks.items():
                checker = messages_of(check.__module__)
                if check.__name__ not in checker.functions:
                    continue
                field_node = call.args[parameters.index("field")]
                field = _field(module, field_node, {**known, key_name: key}, scope)
                for text, hint in _pairs(checker, checker.functions[check.__name__], {}):
                    problems.append(Problem(field, text, hint))
    return problems


def _call_sites(module: Messages, scope: ast.FunctionDef) -> list[dict[str, Any]]:
    """The known arguments of each call of ``scope`` in its module (one
    empty binding when none is known): ``_one_of(name, entry, "cron",
    "every", ...)`` shows ``'cron'`` and ``'every'``."""
    known = [
        module.bind(scope, node, {})
        for node in ast.walk(module.tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == scope.name
    ]
    known = [{**module.literal_locals(scope), **k} for k in known if k]
    return known or [module.literal_locals(scope)]


def _field(
    module: Messages, node: ast.expr | None, known: dict[str, Any], scope: ast.AST
) -> str | None:
    if node is None:
        return None
    value = module.evaluate(node, known)
    if value is None or isinstance(value, str):
        return value
    forms = module.render(node, known, scope)
    return forms[0] if len(forms) == 1 and PLACEHOLDER not in forms[0] else PLACEHOLDER


def _field_checks(
    module: Messages, scope: ast.FunctionDef, call: ast.Call
) -> list[tuple[str, dict[str, Any]]]:
    """(the loop's key name, the dict of field checks) of the loop around
    ``call`` that takes each check from ``SOME_DICT.items()``."""
    found = []
    for loop in ast.walk(scope):
        if not (
            isinstance(loop, ast.For)
            and isinstance(loop.target, ast.Tuple)
            and len(loop.target.elts) == 2
            and all(isinstance(e, ast.Name) for e in loop.target.elts)
            and isinstance(loop.iter, ast.Call)
            and isinstance(loop.iter.func, ast.Attribute)
            and loop.iter.func.attr == "items"
            and any(node is call for node in ast.walk(loop))
        ):
            continue
        checks = module.evaluate(loop.iter.func.value, {})
        if isinstance(checks, dict):
            key_name = loop.target.elts[0]
            assert isinstance(key_name, ast.Name)
            found.append((key_name.id, checks))
    return found


def _pairs(
    module: Messages, function: ast.FunctionDef, bound: dict[str, Any]
) -> list[tuple[str, str]]:
    """The (problem, hint) pairs that a field check returns: ``[(problem,
    hint)]``, a choice of such lists, or what another check it returns gives."""
    known = {**module.literal_locals(function), **bound}
    pairs: list[tuple[str, str]] = []

    def returned(node: ast.expr) -> None:
        if isinstance(node, ast.List):
            for element in node.elts:
                if isinstance(element, ast.Tuple) and len(element.elts) == 2:
                    hint = " / ".join(module.render(element.elts[1], known, function))
                    for text in module.render(element.elts[0], known, function):
                        pairs.append((text, hint))
        elif isinstance(node, ast.IfExp):
            returned(node.body)
            returned(node.orelse)
        elif isinstance(node, ast.Call):
            target = module.resolve(node.func, function)
            if target is not None:
                arguments = module.bind(target[1], node, known)
                pairs.extend(_pairs(*target, arguments))

    for node in sorted(
        (n for n in ast.walk(function) if isinstance(n, ast.Return) and n.value is not None),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        assert node.value is not None
        returned(node.value)
    return [pair for pair in pairs if pair[0] != PLACEHOLDER] or pairs
