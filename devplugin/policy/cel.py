"""The part of CEL that device selectors are written in here (pure).

The extender predicts the scheduler's allocator, so it has to judge the
selectors of DeviceClasses and claims itself. It understands what the
chart's classes and templates use, and what people commonly write beside
them: `device.driver`, `device.attributes["domain"].name` (and the same
with `["name"]`), `has(...)` of such a member, literals (integers, strings,
booleans), `== != < <= > >=`, `! && ||` and parentheses. Anything else
(`device.capacity`, quantities, versions, functions, macros) is refused
when compiled: `Unsupported`, and the extender then says nothing about the
pod rather than guess. Evaluation follows CEL where it matters for
selectors: a missing key is an error, `&&` and `||` absorb an error when
the other side decides, comparing values of different types is an error.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_EXPRESSION = 10_000
MAX_DEPTH = 32


class Unsupported(ValueError):
    """An expression outside the subset (or not CEL at all)."""


class EvalError(ValueError):
    """A runtime error, as CEL would raise one (the allocator then errors out)."""


_TOKEN = re.compile(
    r"""\s*(?:
        (?P<int>-?\d+)(?![\w.])
      | (?P<str>"(?:[^"\\\n]|\\.)*")
      | (?P<op>==|!=|<=|>=|&&|\|\||[<>!().\[\]])
      | (?P<name>[A-Za-z_]\w*)
    )""",
    re.VERBOSE,
)
_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "/": "/"}


def _tokens(text: str) -> list[tuple[str, str]]:
    if len(text) > MAX_EXPRESSION:
        raise Unsupported(f"expression longer than {MAX_EXPRESSION} characters")
    found: list[tuple[str, str]] = []
    position = 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise Unsupported(f"cannot read the expression at {text[position : position + 20]!r}")
        kind = match.lastgroup
        assert kind is not None
        found.append((kind, match.group(kind)))
        position = match.end()
    return found


def _string(literal: str) -> str:
    body = literal[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        if body[i] == "\\":
            escaped = body[i + 1]
            if escaped not in _ESCAPES:
                raise Unsupported(f"string escape \\{escaped}")
            out.append(_ESCAPES[escaped])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


# A compiled expression: the device view in, a value out (or EvalError).
Program = Callable[[Mapping[str, Any]], Any]


@dataclass
class _Parser:
    tokens: list[tuple[str, str]]
    at: int = 0
    depth: int = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise Unsupported(f"expected {value or 'more'} at token {self.at}")
        self.at += 1
        return token

    def nested(self) -> None:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Unsupported("expression nested too deeply")

    def expression(self) -> Program:
        self.nested()
        left = self.conjunction()
        while (token := self.peek()) is not None and token[1] == "||":
            self.take()
            left = _or(left, self.conjunction())
        self.depth -= 1
        return left

    def conjunction(self) -> Program:
        left = self.unary()
        while (token := self.peek()) is not None and token[1] == "&&":
            self.take()
            left = _and(left, self.unary())
        return left

    def unary(self) -> Program:
        token = self.peek()
        if token is not None and token[1] == "!":
            self.take()
            self.nested()
            inner = self.unary()
            self.depth -= 1
            return _not(inner)
        return self.relation()

    def relation(self) -> Program:
        left = self.primary()
        token = self.peek()
        if token is not None and token[1] in _COMPARE:
            self.take()
            return _compare(token[1], left, self.primary())
        return left

    def primary(self) -> Program:
        kind, value = self.take()
        if kind == "int":
            number = int(value)
            return lambda _: number
        if kind == "str":
            text = _string(value)
            return lambda _: text
        if value in ("true", "false"):
            truth = value == "true"
            return lambda _: truth
        if value == "(":
            inner = self.expression()
            self.take(")")
            return inner
        if value == "has":
            self.take("(")
            path = self.member(self.take()[1])
            self.take(")")
            if len(path) < 2:
                raise Unsupported("has() needs a field selection")
            return _has(path)
        if kind == "name":
            return _lookup(self.member(value))
        raise Unsupported(f"unexpected {value!r}")

    def member(self, head: str) -> tuple[str, ...]:
        if head != "device":
            raise Unsupported(f"unknown name {head!r} (only `device` is defined)")
        path = [head]
        while (token := self.peek()) is not None and token[1] in (".", "["):
            self.take()
            if token[1] == ".":
                kind, name = self.take()
                if kind != "name":
                    raise Unsupported("a field name must follow '.'")
                if self.peek() is not None and self.peek() == ("op", "("):
                    raise Unsupported(f"function {name}() is not supported")
                path.append(name)
            else:
                kind, literal = self.take()
                if kind != "str":
                    raise Unsupported("only string keys are supported")
                path.append(_string(literal))
                self.take("]")
        if path[1:2] not in (["driver"], ["attributes"]):
            raise Unsupported("only device.driver and device.attributes are supported")
        if path[1] == "driver" and len(path) != 2:
            raise Unsupported("device.driver has no fields")
        if path[1] == "attributes" and len(path) > 4:
            raise Unsupported("an attribute value has no fields")
        return tuple(path)


_COMPARE = {"==", "!=", "<", "<=", ">", ">="}


def _walk(device: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = device
    for key in path[1:]:
        if not isinstance(value, Mapping) or key not in value:
            raise EvalError(f"no such key: {key}")
        value = value[key]
    return value


def _lookup(path: tuple[str, ...]) -> Program:
    return lambda device: _walk(device, path)


def _has(path: tuple[str, ...]) -> Program:
    def run(device: Mapping[str, Any]) -> Any:
        holder = _walk(device, path[:-1])
        if not isinstance(holder, Mapping):
            raise EvalError("has() on a value without fields")
        return path[-1] in holder

    return run


def _truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise EvalError(f"no such overload: a {type(value).__name__} where a bool is needed")
    return value


def _not(inner: Program) -> Program:
    return lambda device: not _truth(inner(device))


def _decided(program: Program, device: Mapping[str, Any]) -> bool | EvalError:
    try:
        return _truth(program(device))
    except EvalError as exc:
        return exc


def _junction(left: Program, right: Program, *, decides: bool) -> Program:
    """`&&` (a false side decides) or `||` (a true side decides): an error
    on one side counts only when the other does not decide."""

    def run(device: Mapping[str, Any]) -> Any:
        first = _decided(left, device)
        if first is decides:
            return decides
        second = _decided(right, device)
        if second is decides:
            return decides
        for side in (first, second):
            if isinstance(side, EvalError):
                raise side
        return not decides

    return run


def _and(left: Program, right: Program) -> Program:
    return _junction(left, right, decides=False)


def _or(left: Program, right: Program) -> Program:
    return _junction(left, right, decides=True)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, str):
        return "string"
    raise EvalError(f"no such overload for a {type(value).__name__}")


def _compare(operator: str, left: Program, right: Program) -> Program:
    def run(device: Mapping[str, Any]) -> Any:
        a, b = left(device), right(device)
        if _kind(a) != _kind(b):
            raise EvalError(f"no such overload: {_kind(a)} {operator} {_kind(b)}")
        if operator == "==":
            return a == b
        if operator == "!=":
            return a != b
        if _kind(a) == "bool":
            raise EvalError(f"no such overload: bool {operator} bool")
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[operator]

    return run


def compile_selector(expression: str) -> Program:
    """A program for one selector expression; Unsupported when it is
    outside the subset."""
    parser = _Parser(_tokens(expression))
    program = parser.expression()
    if parser.peek() is not None:
        raise Unsupported(f"unexpected {parser.peek()[1]!r} after the expression")  # type: ignore[index]
    return program


def matches(program: Program, device: Mapping[str, Any]) -> bool:
    """The selector's verdict on a device view ({driver, attributes:
    {domain: {name: value}}}); EvalError as CEL would fail."""
    return _truth(program(device))
