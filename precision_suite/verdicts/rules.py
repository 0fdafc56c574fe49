"""Declarative per-layer threshold and growth rules: their grammar and their check on a run.

Rules are written as short strings (or TOML tables) and configured in pyproject.toml under
[tool.precision_suite] (verdicts.project_config) or passed per test:

    "underflow <= 1e-3 @ tensor=gradient, layout=1x128"      bound on every layer and step
    "distortion >= 0.999 @ tensor=activation, steps=last"    only the last sampled step
    "attention_norm <= sqrt(N) @ attention=softmax"          bound from the run, only softmax runs
    "growth(attention_norm) <= 4 @ layer=0|11"               last step <= 4 x first step, per layer
    "underflow <= 1e-3 @ module=*.mlp.*, tensor=gradient"    per module (globs), not per layer

After `@`: `module` (globs), `layer`, `tensor`, `layout` select coordinates (alternatives separated
by `|`), `steps` is `all` (default) or `last`, and any other key must match a field of the run's
spec. A rule with a `module` selector, or on a run whose modules carry no block index, is checked
per module (views.module_view); otherwise per layer. The grammar and the reasons for it are in
docs/baselines.md. This module parses rules; verdicts.rule_check checks them on a run.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Selector = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class BoundRule:
    """`metric op bound` on the selected cells; bound is a number or an expression of run attrs."""

    metric: str
    op: str  # "<=" | ">="
    bound: float | str
    select: Selector = ()
    steps: str = "all"  # "all" | "last"

    def __str__(self) -> str:
        return _rule_text(self.metric, self.op, self.bound, self.select, self.steps)


@dataclass(frozen=True, slots=True)
class GrowthRule:
    """Per layer (and tensor/layout): value at the last sampled step <= factor x value at the first."""

    metric: str
    factor: float | str
    select: Selector = ()

    def __str__(self) -> str:
        return _rule_text(f"growth({self.metric})", "<=", self.factor, self.select, "all")


Rule = BoundRule | GrowthRule

_RULE_RE = re.compile(
    r"""^\s*(?:growth\(\s*(?P<growth>\w+)\s*\)|(?P<metric>\w+))\s*
                          (?P<op><=|>=)\s*(?P<bound>[^@]+?)\s*(?:@(?P<select>.*))?$""",
    re.X,
)

_DICT_BOUND_KEYS = {"max": "<=", "min": ">="}


def parse_rule(rule: str | Mapping[str, Any] | Rule) -> Rule:
    """A rule from its string form, its table form, or a Rule (returned as is).

    Table form: {metric = "underflow", max = 1e-3, tensor = "gradient", layout = "1x128"}, with
    exactly one of max / min / growth; other keys are selectors as in the string form.
    """
    if isinstance(rule, (BoundRule, GrowthRule)):
        return rule
    if isinstance(rule, str):
        return _parse_rule_text(rule)
    if isinstance(rule, Mapping):
        return _parse_rule_table(rule)
    raise ValueError(
        f"a rule must be a string like 'underflow <= 1e-3 @ tensor=gradient' or a table, got {rule!r}"
    )


def parse_rules(rules: Iterable[str | Mapping[str, Any] | Rule] | None) -> tuple[Rule, ...]:
    parsed = []
    for index, rule in enumerate(rules or ()):
        try:
            parsed.append(parse_rule(rule))
        except ValueError as err:
            raise ValueError(f"rule {index + 1} ({rule!r}): {err}") from None
    return tuple(parsed)


def _parse_rule_text(text: str) -> Rule:
    match = _RULE_RE.match(text)
    if not match:
        raise ValueError(
            "expected 'metric <= bound', 'metric >= bound' or 'growth(metric) <= factor', "
            "optionally followed by '@ key=value, ...'"
        )
    select: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in (match["select"] or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"selector {part!r} is not key=value")
        select[key.strip()] = value.strip().split("|")
    bound = _number_or_expression(match["bound"])
    if match["growth"]:
        if match["op"] != "<=":
            raise ValueError("a growth rule is 'growth(metric) <= factor'")
        return _growth_rule(match["growth"], bound, select)
    return _bound_rule(match["metric"], match["op"], bound, select)


def _parse_rule_table(table: Mapping[str, Any]) -> Rule:
    select = dict(table)
    metric = select.pop("metric", None)
    if not isinstance(metric, str):
        raise ValueError("a rule table needs metric = '<name>'")
    given = [k for k in ("max", "min", "growth") if k in select]
    if len(given) != 1:
        raise ValueError("a rule table needs exactly one of max, min or growth")
    bound = _number_or_expression(select.pop(given[0]))
    if given[0] == "growth":
        return _growth_rule(metric, bound, select)
    return _bound_rule(metric, _DICT_BOUND_KEYS[given[0]], bound, select)


def _bound_rule(metric: str, op: str, bound: float | str, select: dict[str, Any]) -> BoundRule:
    steps = select.pop("steps", ["all"])
    steps = steps[0] if isinstance(steps, list) and len(steps) == 1 else steps
    if steps not in ("all", "last"):
        raise ValueError(f"steps={steps!r}: use steps=all or steps=last")
    return BoundRule(metric, op, bound, _selector(select), steps)


def _growth_rule(metric: str, factor: float | str, select: dict[str, Any]) -> GrowthRule:
    if "steps" in select:
        raise ValueError("a growth rule always compares the last sampled step with the first; drop steps=")
    if isinstance(factor, float) and not factor > 0:
        raise ValueError(f"growth factor must be > 0, got {factor}")
    return GrowthRule(metric, factor, _selector(select))


def _selector(select: Mapping[str, Any]) -> Selector:
    items = []
    for key, values in select.items():
        values = values if isinstance(values, (list, tuple)) else [values]
        values = tuple(str(v) for v in values)
        if key == "layer":
            bad = [v for v in values if not re.fullmatch(r"\d+", v)]
            if bad:
                raise ValueError(f"layer={'|'.join(bad)}: layers are integers, e.g. layer=0|4|8")
        items.append((str(key), values))
    return tuple(items)


def _number_or_expression(value: Any) -> float | str:
    if isinstance(value, bool):
        raise ValueError(f"bound {value!r} is not a number or expression")
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    evaluate_expression(text, names=None)  # syntax check now; names are resolved per run
    return text


def _rule_text(metric: str, op: str, bound: float | str, select: Selector, steps: str) -> str:
    parts = [f"{k}={'|'.join(v)}" for k, v in select]
    if steps != "all":
        parts.append(f"steps={steps}")
    bound_text = f"{bound:g}" if isinstance(bound, float) else bound
    return f"{metric} {op} {bound_text}" + (f" @ {', '.join(parts)}" if parts else "")


_FUNCTIONS = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "min": min, "max": max}

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}


def evaluate_expression(text: str, names: Mapping[str, float] | None) -> float:
    """Evaluate an arithmetic bound such as '2*sqrt(N)' (numbers, names, + - * / **, sqrt, log,
    exp, min, max). With names=None only the syntax is checked: nothing is evaluated (a bound
    such as 1/(N-1) is fine for every run with N > 1), and NaN stands for the result."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"bound {text!r} is not an arithmetic expression") from None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return float(node.value)
        if isinstance(node, ast.Name):
            if names is None:
                return math.nan
            if node.id not in names:
                raise ValueError(
                    f"bound {text!r}: unknown name {node.id!r}; this run provides "
                    f"{', '.join(sorted(names)) or 'no numeric attributes'}"
                )
            return float(names[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            return math.nan if names is None else _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _FUNCTIONS
            and not node.keywords
        ):
            args = [walk(arg) for arg in node.args]
            return math.nan if names is None else float(_FUNCTIONS[node.func.id](*args))
        raise ValueError(
            f"bound {text!r}: only numbers, names, + - * / ** and {', '.join(_FUNCTIONS)} are allowed"
        )

    try:
        return walk(tree)
    except (ArithmeticError, TypeError, ValueError) as err:  # 1/0, log(-1), 10**400, min()
        if isinstance(err, ValueError) and str(err).startswith("bound "):
            raise
        raise ValueError(f"bound {text!r} cannot be evaluated for this run: {err}") from None
