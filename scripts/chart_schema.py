"""Write (or check) the chart's generated files.

charts/devplugin/values.schema.json: the `config` part is generated from
devplugin's configuration dataclasses, so the chart rejects exactly the
keys and values the daemon would reject; the rest describes the chart's own
values.

charts/devplugin/files/claim-templates.yaml: the ResourceClaimTemplates the
chart installs, from `devplugin.policy.claim_templates` (the same code as
`devplugin claim-template`), with `__DRIVER__` and `__NAMESPACE__` for the
chart to fill in.

charts/devplugin/files/dashboard.json: the Grafana dashboard, from the
panel table in scripts/dashboard.py.

    python scripts/chart_schema.py          # rewrite
    python scripts/chart_schema.py --check  # exit 1 when stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml
from dashboard import render_dashboard  # scripts/dashboard.py, beside this one

from devplugin.config import json_schema
from devplugin.policy.claim_templates import CHART_SHAPES, claim_template

CHART = Path(__file__).resolve().parent.parent / "charts" / "devplugin"
SCHEMA_FILE = CHART / "values.schema.json"
TEMPLATES_FILE = CHART / "files" / "claim-templates.yaml"
DASHBOARD_FILE = CHART / "files" / "dashboard.json"
PLACEHOLDER_DRIVER = "__DRIVER__"
PLACEHOLDER_NAMESPACE = "__NAMESPACE__"


def obj(properties: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


STRING = {"type": "string"}
BOOL = {"type": "boolean"}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
POSITIVE = {"type": "integer", "minimum": 1}
ABSOLUTE = {"type": "string", "pattern": "^/"}
ANY_OBJECT = {"type": "object"}
PROBE = obj(
    {
        "enabled": BOOL,
        "initialDelaySeconds": {"type": "integer", "minimum": 0},
        "periodSeconds": POSITIVE,
        "failureThreshold": POSITIVE,
    }
)


HOST_PATHS = (
    "devicePlugins", "podResources", "sys", "dev", "state", "cdiStatic", "cdiDynamic",
    "kubeletPlugins", "kubeletRegistry",
)  # fmt: skip


def _metrics() -> dict[str, Any]:
    return obj(
        {
            "enabled": BOOL,
            "port": PORT,
            "service": obj({"enabled": BOOL, "annotations": ANY_OBJECT}),
            "serviceMonitor": obj(
                {
                    "enabled": BOOL,
                    "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                    "labels": {"type": "object", "additionalProperties": STRING},
                }
            ),
            "prometheusRule": obj(
                {
                    "enabled": BOOL,
                    "labels": {"type": "object", "additionalProperties": STRING},
                    "runbookUrl": {"type": "string", "pattern": "^https?://"},
                }
            ),
            "dashboard": obj(
                {
                    "enabled": BOOL,
                    "labels": {"type": "object", "additionalProperties": STRING},
                    "annotations": {"type": "object", "additionalProperties": STRING},
                }
            ),
        }
    )


def _extender() -> dict[str, Any]:
    return obj(
        {
            "enabled": BOOL,
            "hostNetwork": BOOL,
            "replicas": {"type": "integer", "minimum": 1},
            "port": PORT,
            "staleAfterSeconds": {"type": "number", "exclusiveMinimum": 0},
            "tlsSecretName": STRING,
            "caBundle": STRING,
            "resources": ANY_OBJECT,
            "scheduler": obj(
                {
                    "enabled": BOOL,
                    "schedulerName": {"type": "string", "minLength": 1},
                    "image": obj(
                        {
                            "repository": {"type": "string", "minLength": 1},
                            "tag": STRING,
                        },
                        required=["repository"],
                    ),
                    "weight": {"type": "integer", "minimum": 1, "maximum": 100},
                    "resources": ANY_OBJECT,
                }
            ),
        }
    )


def _dra() -> dict[str, Any]:
    return obj(
        {
            "deviceClasses": BOOL,
            "claimTemplates": obj(
                {
                    "enabled": BOOL,
                    "namespaces": {
                        "type": "array",
                        "items": {
                            "type": "string",
                            "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                        },
                    },
                }
            ),
        }
    )


def values_schema() -> dict[str, Any]:
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "devplugin chart values",
        **obj(
            {
                "image": obj(
                    {
                        "repository": {"type": "string", "minLength": 1},
                        "tag": STRING,
                        "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
                    },
                    required=["repository"],
                ),
                # Set by a parent chart when this one is a subchart.
                "global": ANY_OBJECT,
                "imagePullSecrets": {"type": "array", "items": ANY_OBJECT},
                "nameOverride": STRING,
                "fullnameOverride": STRING,
                "priorityClassName": STRING,
                "updateStrategy": obj(
                    {
                        "type": {"enum": ["RollingUpdate", "OnDelete"]},
                        "rollingUpdate": ANY_OBJECT,
                    }
                ),
                "nodeSelector": {"type": "object", "additionalProperties": STRING},
                "affinity": {"type": ["object", "null"]},
                "tolerations": {"type": "array", "items": ANY_OBJECT},
                "runtimeClassName": STRING,
                "privileged": BOOL,
                "hostNetwork": BOOL,
                "kubernetesService": obj({"host": STRING, "port": PORT}),
                "resources": ANY_OBJECT,
                "hostPaths": obj(
                    {
                        **{key: ABSOLUTE for key in HOST_PATHS},
                        # The kubelet's config file; "": not read.
                        "kubeletConfig": {"type": "string", "pattern": "^(/.*)?$"},
                    }
                ),
                "metrics": _metrics(),
                "probes": obj({"liveness": PROBE, "readiness": PROBE}),
                "serviceAccount": obj({"create": BOOL, "name": STRING, "annotations": ANY_OBJECT}),
                "rbac": obj({"create": BOOL, "nodeRestriction": BOOL}),
                "extender": _extender(),
                "dra": _dra(),
                "config": json_schema(),
            }
        ),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def render_templates() -> str:
    documents = [
        claim_template(shape, PLACEHOLDER_DRIVER, namespace=PLACEHOLDER_NAMESPACE)
        for shape in CHART_SHAPES
    ]
    header = (
        "# Generated by scripts/chart_schema.py from devplugin.policy.claim_templates;\n"
        "# do not edit. The chart fills in __DRIVER__ and __NAMESPACE__.\n"
    )
    # The placeholder is not a DNS name: the text is filled in before YAML is read.
    return header + "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in documents)


GENERATED = (
    (SCHEMA_FILE, render),
    (TEMPLATES_FILE, render_templates),
    (DASHBOARD_FILE, render_dashboard),
)


def main() -> int:
    if "--check" in sys.argv[1:]:
        stale = [
            path for path, make in GENERATED if not path.exists() or path.read_text() != make()
        ]
        for path in stale:
            print(f"{path} is stale: run `make chart-schema`", file=sys.stderr)
        return 1 if stale else 0
    for path, make in GENERATED:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(make())
    return 0


if __name__ == "__main__":
    sys.exit(main())
