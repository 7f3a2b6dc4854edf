"""Write (or check) charts/devplugin/values.schema.json.

The `config` part is generated from devplugin's configuration dataclasses,
so the chart rejects exactly the keys and values the daemon would reject;
the rest describes the chart's own values.

    python scripts/chart_schema.py          # rewrite
    python scripts/chart_schema.py --check  # exit 1 when stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from devplugin.config import json_schema

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "charts" / "devplugin" / "values.schema.json"


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


HOST_PATHS = ("devicePlugins", "podResources", "sys", "dev", "state", "cdiStatic", "cdiDynamic")


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
                "resources": ANY_OBJECT,
                "hostPaths": obj({key: ABSOLUTE for key in HOST_PATHS}),
                "metrics": obj(
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
                    }
                ),
                "probes": obj({"liveness": PROBE, "readiness": PROBE}),
                "serviceAccount": obj({"create": BOOL, "name": STRING, "annotations": ANY_OBJECT}),
                "rbac": obj({"create": BOOL, "nodeRestriction": BOOL}),
                "extender": obj(
                    {
                        "enabled": BOOL,
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
                ),
                "config": json_schema(),
            }
        ),
    }


def render() -> str:
    return json.dumps(values_schema(), indent=2) + "\n"


def main() -> int:
    if "--check" in sys.argv[1:]:
        if SCHEMA_FILE.read_text() != render():
            print(f"{SCHEMA_FILE} is stale: run `make chart-schema`", file=sys.stderr)
            return 1
        return 0
    SCHEMA_FILE.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
