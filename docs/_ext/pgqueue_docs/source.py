"""Reading the package's source for the generators: its files, the comments
above code (``Comments``), the messages a function builds (``Messages``),
and prose turned into reST (``rst_text``).
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "django_pgqueue"
PLACEHOLDER = "…"  # a value only known when the message is made


def package_dir() -> Path:
    """Where the documented package's files are (the checkout's)."""
    return Path(importlib.import_module(PACKAGE).__file__).parent


def source_of(module: ModuleType | str) -> tuple[str, Path]:
    """A module's source text and file."""
    if isinstance(module, str):
        module = module_or_stand_in(module)
    path = Path(inspect.getsourcefile(module) or module.__file__)
    return path.read_text(encoding="utf-8"), path


def module_or_stand_in(name: str) -> ModuleType:
    """The module, or, when it cannot be imported in this build (the Tasks
    backend needs Django 6), an empty module with its file: its source can
    still be read, its constants are then unknown (``…``)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        path = package_dir().parent.joinpath(*name.split("."))
        stand_in = ModuleType(name)
        stand_in.__file__ = str(path / "__init__.py" if path.is_dir() else path.with_suffix(".py"))
        return stand_in


def package_modules() -> Iterator[tuple[str, Path]]:
    """``(dotted name, file)`` of every module of the package but its
    migrations."""
    root = package_dir()
    for path in sorted(root.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        relative = path.relative_to(root.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        yield name, path


def enclosing_function(tree: ast.AST, target: ast.AST) -> ast.AST | None:
    """The innermost function around ``target`` (``ast.walk`` goes outside in)."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
            child is target for child in ast.walk(node)
        ):
            found = node
    return found


# --- reST text --------------------------------------------------------------------------

# A command-line option, with a value if one is given ("--queues=a,b").
_OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][\w-]*(?:=[\w.:/-]+(?:,[\w.:/-]+)*)?)")
_LITERAL_RE = re.compile(r"(``.+?``)")


def rst_text(text: str, link_settings: bool = True, own: str = "") -> str:
    """Plain prose (a comment, a help text, a check message) as reST: inline
    markup characters escaped outside ``double back-quoted`` spans, and
    every PGQUEUE key turned into a link to its setting (but ``own``: a
    setting's own text names the key, or an SQL word such as NOTIFY)."""
    from django_pgqueue.conf import DEFAULTS

    parts = _LITERAL_RE.split(text)
    for i in range(0, len(parts), 2):
        part = re.sub(r"([\\*`|])", r"\\\1", parts[i])
        part = re.sub(r"(?<=\w)_(?=\W|$)", r"\\_", part)  # a trailing _ is a reference
        if link_settings:
            part = re.sub(
                # Inline markup must end before a space or punctuation, not "[".
                r"PGQUEUE\[(['\"])([A-Z][A-Z0-9_]+)\1\](?=[\s\-.,:;!?/'\")\]}>]|$)",
                lambda m: (
                    f":setting:`{m.group(0)} <{m.group(2)}>`"
                    if m.group(2) in DEFAULTS and m.group(2) != own
                    else m.group(0)
                ),
                part,
            )
            part = re.sub(
                r"(?<![\w\"'\[\\<`])([A-Z][A-Z0-9_]+)(?![\w\"'\]\\>`])",
                lambda m: (
                    f":setting:`{m.group(1)}`"
                    if m.group(1) in DEFAULTS and m.group(1) != own
                    else m.group(1)
                ),
                part.replace("\\_", "\0"),
            ).replace("\0", "\\_")
        # Command-line options as literals: prose would turn "--" into a dash.
        parts[i] = _OPTION_RE.sub(r"``\1``", part)
    return "".join(parts)


def prose_rst(text: str) -> list[str]:
    """A plain-text docstring as reST: its paragraphs as prose (escaped,
    settings linked), each indented block as a literal block."""
    lines: list[str] = []
    paragraph: list[str] = []
    block: list[str] = []

    def flush() -> None:
        if paragraph:
            joined = " ".join(paragraph)
            lines.extend([rst_text(joined[0].upper() + joined[1:]), ""])
            paragraph.clear()
        if block:
            while block and not block[-1].strip():
                block.pop()
            code = textwrap.dedent("\n".join(block)).splitlines()
            lines.extend([".. code-block:: text", "", *indent(code), ""])
            block.clear()

    for line in text.splitlines():
        if line.startswith((" ", "\t")) or (block and not line.strip()):
            if paragraph:
                flush()
            block.append(line)
        elif not line.strip():
            flush()
        else:
            if block:
                flush()
            paragraph.append(line.strip())
    flush()
    return lines


def indent(lines: list[str], by: int = 3) -> list[str]:
    return [(" " * by + line) if line else "" for line in lines]


def heading(text: str, char: str) -> list[str]:
    return [text, char * len(text), ""]


# --- comments above code -----------------------------------------------------------------

PRAGMA_RE = re.compile(r"^(noqa|type:|fmt:|pragma|nosec)")


@dataclass
class Comments:
    """The comments of a source file by line: whole-line ones, and those
    after code on the line."""

    full: dict[int, str]
    inline: dict[int, str]

    @classmethod
    def of(cls, source: str) -> Comments:
        full, inline = {}, {}
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.COMMENT:
                continue
            text = token.string[1:]
            text = text[1:] if text.startswith(" ") else text
            if token.line[: token.start[1]].strip():
                if not PRAGMA_RE.match(text):
                    inline[token.start[0]] = text
            else:
                full[token.start[0]] = text
        return cls(full, inline)

    def above(self, line: int) -> list[str]:
        """The paragraphs of the comment block that ends on the line before
        ``line`` (a ``#`` line alone separates paragraphs)."""
        lines = []
        number = line - 1
        while number in self.full:
            lines.insert(0, self.full[number])
            number -= 1
        paragraphs, current = [], []
        for text in lines:
            if text.strip():
                current.append(text.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        if current:
            paragraphs.append(" ".join(current))
        return paragraphs

    def within(self, first: int, last: int) -> str:
        return " ".join(self.inline[n] for n in range(first, last + 1) if n in self.inline)


# --- strings a function can return (check messages) ----------------------------------------


class Messages:
    """The strings a module's code builds for messages, read from its AST:
    constants, f-strings and concatenations, with each value that is known
    without running the check (a module constant, a constant argument, a
    literal local) filled in, and ``…`` for the rest."""

    def __init__(self, module: ModuleType | str) -> None:
        if isinstance(module, str):
            module = module_or_stand_in(module)
        self.module = module
        source, self.path = source_of(module)
        self.tree = ast.parse(source)
        self.functions = {
            node.name: node for node in self.tree.body if isinstance(node, ast.FunctionDef)
        }

    def render(self, node: ast.expr, known: dict[str, Any], scope: ast.AST | None) -> list[str]:
        """The strings ``node`` can be; several when it names the result of
        a check function of this module."""
        value = self.evaluate(node, known)
        if isinstance(value, str):
            return [value]
        if isinstance(node, ast.Constant):
            return [str(node.value)]
        if isinstance(node, ast.JoinedStr):
            results = [""]
            for part in node.values:
                if isinstance(part, ast.Constant):
                    results = [r + str(part.value) for r in results]
                    continue
                assert isinstance(part, ast.FormattedValue)
                options = self._formatted(part, known, scope)
                results = [r + o for r in results for o in options]
            return results
        if isinstance(node, ast.IfExp):  # "None if ok else 'must be ...'"
            branches = [b for b in (node.body, node.orelse) if not is_none(b)]
            return [m for b in branches for m in self.render(b, known, scope)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = self.render(node.left, known, scope)
            right = self.render(node.right, known, scope)
            return [a + b for a in left for b in right]
        called = self._called(node, known, scope)
        if called is not None:
            return called
        return [PLACEHOLDER]

    def _formatted(
        self, part: ast.FormattedValue, known: dict[str, Any], scope: ast.AST | None
    ) -> list[str]:
        value = self.evaluate(part.value, known)
        if value is not UNKNOWN:
            spec = ""
            if part.format_spec is not None:
                spec = "".join(self.render(part.format_spec, known, scope)[:1])
            if part.conversion == ord("r"):
                value = repr(value)
            try:
                return [format(value, spec)]
            except (TypeError, ValueError):
                return [PLACEHOLDER]
        called = self._called(part.value, known, scope)
        return called if called is not None else [PLACEHOLDER]

    def _called(
        self, node: ast.expr, known: dict[str, Any], scope: ast.AST | None
    ) -> list[str] | None:
        """The messages of a check function that ``node`` calls (or names
        the result of, ``problem = check(value)``, or a choice of, ``said =
        "both" if ... else "neither"``), or None. The function may be in
        another module of the package (``conf.name_problem(...)``).
        ``str(exc)`` of an exception caught around a call: the messages of
        what that function raises."""
        if isinstance(node, ast.Name) and scope is not None:
            # The assignment that the name's use follows (the last one above it).
            assigns = [
                assign
                for assign in ast.walk(scope)
                if isinstance(assign, ast.Assign)
                and len(assign.targets) == 1
                and isinstance(assign.targets[0], ast.Name)
                and assign.targets[0].id == node.id
                and assign.lineno <= node.lineno
                and not any(sub is node for sub in ast.walk(assign.value))  # x = x + ...
            ]
            if not assigns:
                return None
            value = max(assigns, key=lambda a: (a.lineno, a.col_offset)).value
            if isinstance(value, ast.Call):
                return self._called(value, known, scope)
            return self.render(value, known, scope)
        if not isinstance(node, ast.Call):
            return None
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "str"
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Name)
            and scope is not None
        ):
            return self._raised_around(node.args[0].id, known, scope)
        target = self.resolve(node.func, scope)
        if target is None:
            return None
        messages, function = target
        # A function that returns no message (a value, a setting) stays "…".
        return messages.returned(function.name, self.bind(function, node, known)) or None

    def bind(self, function: ast.FunctionDef, call: ast.Call, known: dict[str, Any]) -> dict:
        """The arguments of ``call`` to ``function`` whose values are known,
        by parameter name."""
        names = [a.arg for a in function.args.args]
        bound = {}
        for name, arg in zip(names, call.args, strict=False):
            value = self.evaluate(arg, known)
            if value is not UNKNOWN:
                bound[name] = value
        return bound

    def resolve(
        self, func: ast.expr, scope: ast.AST | None
    ) -> tuple[Messages, ast.FunctionDef] | None:
        """The function of the package that ``func`` (a call's callee)
        names, with the Messages of its module; None for anything else."""
        if isinstance(func, ast.Name) and func.id in self.functions:
            return self, self.functions[func.id]
        target = self.evaluate(func, self.imported_in(scope))
        if not inspect.isfunction(target) or not target.__module__.startswith(PACKAGE + "."):
            return None
        other = messages_of(target.__module__)
        function = other.functions.get(target.__name__)
        return None if function is None else (other, function)

    def imported_in(self, scope: ast.AST | None) -> dict[str, Any]:
        """The names that ``import`` statements inside ``scope`` bind."""
        found: dict[str, Any] = {}
        for node in ast.walk(scope) if scope is not None else ():
            try:
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    source = importlib.import_module(node.module)
                    for alias in node.names:
                        found[alias.asname or alias.name] = getattr(source, alias.name)
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        bound = alias.name if alias.asname else alias.name.partition(".")[0]
                        found[alias.asname or bound] = importlib.import_module(bound)
            except (ImportError, AttributeError):
                continue
        return found

    def _raised_around(self, name: str, known: dict[str, Any], scope: ast.AST) -> list[str] | None:
        """The messages of the exceptions that the calls in the ``try`` of
        ``except ... as name`` raise."""
        for node in ast.walk(scope):
            if not isinstance(node, ast.Try) or not any(h.name == name for h in node.handlers):
                continue
            messages: list[str] = []
            for call in (c for s in node.body for c in ast.walk(s) if isinstance(c, ast.Call)):
                target = self.resolve(call.func, scope)
                if target is not None:
                    other, function = target
                    bound = {**other.literal_locals(function), **self.bind(function, call, known)}
                    for found in ast.walk(function):
                        if isinstance(found, ast.Raise) and isinstance(found.exc, ast.Call):
                            for argument in found.exc.args[:1]:
                                for message in other.render(argument, bound, function):
                                    if message not in messages:
                                        messages.append(message)
            return messages or None
        return None

    def returned(self, name: str, known: dict[str, Any] | None = None) -> list[str]:
        """Every message the module function ``name`` returns (None aside)."""
        function = self.functions[name]
        known = {**self.literal_locals(function), **(known or {})}
        messages: list[str] = []
        returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
        for node in sorted(returns, key=lambda n: (n.lineno, n.col_offset)):
            if node.value is not None and not is_none(node.value):
                for message in self.render(node.value, known, function):
                    if message != PLACEHOLDER and message not in messages:
                        messages.append(message)
        return messages

    def literal_locals(self, function: ast.FunctionDef) -> dict[str, Any]:
        """The locals of ``function`` assigned a literal, once."""
        found = {}
        assigned: dict[str, int] = {}
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                name = node.targets[0].id
                assigned[name] = assigned.get(name, 0) + 1
                try:
                    found[name] = ast.literal_eval(node.value)
                except ValueError:
                    pass
        found = {name: value for name, value in found.items() if assigned[name] == 1}
        # A name built in steps (hint = "..."; hint += ...): its value after
        # the function's first statements, when every step is known.
        stepped = {
            node.target.id
            for node in ast.walk(function)
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
        }
        for name in stepped:
            found.pop(name, None)
        for statement in function.body:
            target = statement.targets[0] if isinstance(statement, ast.Assign) else None
            if isinstance(statement, ast.AugAssign):
                target = statement.target
            if not (isinstance(target, ast.Name) and target.id in stepped):
                continue
            assert isinstance(statement, ast.Assign | ast.AugAssign)
            value = self.evaluate(statement.value, found)
            if isinstance(statement, ast.AugAssign):
                known = target.id in found and isinstance(statement.op, ast.Add)
                value = found[target.id] + value if known and value is not UNKNOWN else UNKNOWN
            if value is UNKNOWN:
                found.pop(target.id, None)
            else:
                found[target.id] = value
        return found

    def evaluate(self, node: ast.expr, known: dict[str, Any]) -> Any:
        """The value of an expression that names only module globals and
        ``known`` values (and builtins), or UNKNOWN. It is our own source,
        and the messages' expressions only join, repr and format values."""
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        generated = {
            t.id
            for comp in ast.walk(node)
            if isinstance(comp, ast.comprehension)
            for t in ast.walk(comp.target)
            if isinstance(t, ast.Name)
        }
        scope = {**vars(self.module), **known}
        if names - set(scope) - generated - set(dir(builtins)):
            return UNKNOWN
        try:
            return eval(compile(ast.Expression(node), str(self.path), "eval"), scope)  # noqa: S307
        except Exception:  # noqa: BLE001  (a value known only at run time)
            return UNKNOWN


UNKNOWN = object()


@functools.cache
def messages_of(module: str) -> Messages:
    """The Messages of a module of the package, read once."""
    return Messages(module)


def is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None
