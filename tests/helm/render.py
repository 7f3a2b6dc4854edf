"""Install the chart with the real Helm engine, once per case.

Runs inside its own Python 3.12 environment (helm-sdkpy needs it): reads a
JSON list of {"name", "values"} cases from stdin (each may also name the
cluster's "kubeVersion" and group/versions it serves "without"), installs
the chart for each against a fresh fake API server, and prints one JSON list of results:
{"name", "ok", "objects" | "error"}. `lint` as second argument runs
`helm lint` on the chart instead.

    HELM_DRIVER=memory python render.py CHART [lint] < cases.json
"""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import helm_sdkpy as helm
from fake_apiserver import serve


def kubeconfig(port: int) -> str:
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: fake, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {}}]\n"
        "contexts: [{name: c, context: {cluster: fake, user: u}}]\n"
        "current-context: c\n"
    )


def install(chart: str, case: dict[str, Any]) -> dict[str, Any]:
    name, values = case["name"], case["values"]
    server, _ = serve(
        kube_version=case.get("kubeVersion", "v1.31.0"), without=case.get("without", ())
    )
    port = server.server_address[1]
    try:
        config = helm.Configuration(namespace="devplugin-system", kubeconfig=kubeconfig(port))
        try:
            asyncio.run(
                helm.Install(config).run(name, chart, values=values, wait=False, timeout=60)
            )
        except helm.HelmError as exc:
            return {"name": name, "ok": False, "error": str(exc)}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/_objects", timeout=10) as reply:
            return {"name": name, "ok": True, "objects": json.load(reply)}
    finally:
        server.shutdown()
        server.server_close()


def main() -> int:
    chart = sys.argv[1]
    if sys.argv[2:] == ["lint"]:
        result = asyncio.run(helm.Lint(helm.Configuration()).run(chart))
        print(json.dumps(result))
        return 0
    cases = json.load(sys.stdin)
    print(json.dumps([install(chart, case) for case in cases]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
