"""Judge an admission request the way the API server applies a
ValidatingAdmissionPolicy, with the CEL evaluated by cel-python.

Covers what the chart's policies use: resourceRules (group, resource with
subresource, operation), matchConditions (all must hold for the policy to
apply), variables (in order, each seeing the ones before), and validations
(each must hold; an expression that fails to evaluate denies, as with
failurePolicy: Fail). Types are dynamic here where the API server checks
them against the schema first, so a test also renders and lints the chart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import celpy

_ENV = celpy.Environment()


@dataclass(frozen=True)
class Verdict:
    applies: bool  # the policy matched the request at all
    allowed: bool
    message: str = ""


def _run(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    return program.evaluate(activation)


def _holds(result: Any) -> bool:
    """True only for a CEL true (not for an error, which is falsy too)."""
    return isinstance(result, celpy.celtypes.BoolType) and bool(result)


def _matches(policy: dict[str, Any], request: dict[str, Any]) -> bool:
    resource = request["resource"]
    sub = request.get("subResource")
    full = resource["resource"] + (f"/{sub}" if sub else "")
    for rule in policy["spec"]["matchConstraints"]["resourceRules"]:
        if (
            resource["group"] in rule["apiGroups"]
            and (full in rule["resources"] or "*" in rule["resources"])
            and request["operation"] in rule["operations"]
        ):
            return True
    return False


def judge(
    policy: dict[str, Any],
    request: dict[str, Any],
    obj: dict[str, Any] | None,
    old: dict[str, Any] | None = None,
) -> Verdict:
    """`request` is an AdmissionRequest's fields (operation, resource,
    subResource, userInfo); `obj` and `old` the new and old objects."""
    if not _matches(policy, request):
        return Verdict(applies=False, allowed=True)
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    spec = policy["spec"]
    for condition in spec.get("matchConditions", []):
        if not _holds(_run(condition["expression"], activation)):
            return Verdict(applies=False, allowed=True)
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        variables[variable["name"]] = _run(variable["expression"], activation)
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    for validation in spec["validations"]:
        result = _run(validation["expression"], activation)
        if _holds(result):
            continue
        if "messageExpression" in validation:
            message = str(_run(validation["messageExpression"], activation))
        else:
            message = validation.get("message", validation["expression"])
        if not isinstance(result, celpy.celtypes.BoolType):  # an evaluation error
            message = f"{message} (error: {result})"
        return Verdict(applies=True, allowed=False, message=message.strip())
    return Verdict(applies=True, allowed=True)
