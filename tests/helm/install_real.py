"""Install the chart into a real cluster with the real Helm engine.

Runs in the Helm environment (Python 3.12, helm-sdkpy), like render.py.
Reads from stdin a JSON object {"kubeconfig": TEXT, "cases": [{"name",
"namespace", "values", "keep"}]}; installs each case as its own release
(Helm asks the real API server which APIs it serves, so the chart renders
for that server's version), records what the release holds, and
uninstalls it unless `keep`. Prints one JSON list: {"name", "ok",
"manifest" | "error"}.

    python install_real.py CHART < request.json
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import helm_sdkpy as helm


def install(chart: str, kubeconfig: str, case: dict[str, Any]) -> dict[str, Any]:
    name, namespace = case["name"], case["namespace"]
    config = helm.Configuration(namespace=namespace, kubeconfig=kubeconfig)
    try:
        release = asyncio.run(
            helm.Install(config).run(
                name,
                chart,
                values=case["values"],
                create_namespace=True,
                wait=False,
                timeout=120,
            )
        )
    except helm.HelmError as exc:
        return {"name": name, "ok": False, "error": str(exc)}
    result = {"name": name, "ok": True, "manifest": str(release.get("manifest", ""))}
    if not case.get("keep"):
        try:
            asyncio.run(helm.Uninstall(config).run(name, wait=True, timeout=120))
        except helm.HelmError as exc:
            result = {"name": name, "ok": False, "error": f"uninstall: {exc}"}
    return result


def main() -> int:
    request = json.load(sys.stdin)
    chart = sys.argv[1]
    print(json.dumps([install(chart, request["kubeconfig"], c) for c in request["cases"]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
