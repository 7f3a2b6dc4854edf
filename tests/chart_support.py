"""The value combinations the chart is installed with: rendered by the
chart tests (tests/cluster/test_chart.py) and installed into real clusters
by the cluster tier (tests/real_cluster/test_chart_install.py)."""

from __future__ import annotations

from typing import Any

CASES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "sharing": {
        "config": {
            "sharing": {
                "gpu": {"replicas": 4, "resource_name": "nvidia.com/gpu.shared", "policy": "packed",
                        "refuse_multiple_per_gpu": True},
                "hca": {"units": 8},
            }
        }
    },
    "hooks": {
        "config": {
            "resources": {
                "gpu": {"hooks": {"init": ["/opt/hooks/gpu-init"], "init_phase": "pre_start",
                                  "cleanup": ["python3", "-m", "devplugin.hooks.gpu_cleanup"],
                                  "timeout_seconds": 120}},
                "hca": {"hooks": {"cleanup": ["python3", "-m", "devplugin.hooks.hca_check"]}},
            },
            "health": {"recovery": "after_cleanup", "xid_ignore": [13, 43]},
        },
        "privileged": True,
    },
    "metrics": {
        "metrics": {
            "port": 9500,
            "service": {"enabled": True, "annotations": {"prometheus.io/scrape": "true"}},
            "serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
        }
    },
    "no-metrics": {"metrics": {"enabled": False}},
    "monitoring": {
        "metrics": {
            "service": {"enabled": True},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "prom"},
                               "runbookUrl": "https://wiki.example.com/gpu/runbooks/"},
            "dashboard": {"enabled": True},
        },
        "extender": {"enabled": True, "tlsSecretName": "extender-tls"},
    },
    "paths-and-probes": {
        "hostPaths": {"devicePlugins": "/data/kubelet/device-plugins",
                      "podResources": "/data/kubelet/pod-resources", "state": "/data/devplugin"},
        "probes": {"liveness": {"enabled": False}, "readiness": {"periodSeconds": 2}},
        "updateStrategy": {"type": "OnDelete"},
        "resources": {"requests": {"cpu": "10m"}},
        "priorityClassName": "gpu-infra-critical",
    },
    "own-service-account": {
        "serviceAccount": {"create": False, "name": "gpu-agents"},
        "rbac": {"create": False},
        "config": {"kubernetes": {"enabled": False}},
    },
    "extender": {
        "extender": {"enabled": True, "port": 9443, "staleAfterSeconds": 90,
                     "scheduler": {"enabled": True, "weight": 7}},
    },
    "cdi": {
        "config": {"resources": {"gpu": {"device_list_strategy": ["cdi-cri"]},
                                 "hca": {"device_list_strategy": ["cdi-cri", "device-nodes"]}},
                   "cdi": {"gpu_device_name": "uuid"}},
        "hostPaths": {"cdiDynamic": "/run/cdi"},
    },
    "managed-cluster": {"extender": {"enabled": True, "scheduler": {"enabled": True}}},
    "pinned-scheduler": {
        "extender": {"enabled": True, "scheduler": {"enabled": True, "image": {
            "repository": "mirror.example.com/kube-scheduler", "tag": "v1.33.5"}}},
    },
    # Without the policy an operator may also keep the daemon off its Node.
    "no-node-restriction": {
        "rbac": {"nodeRestriction": False},
        "config": {"kubernetes": {"node_labels": False}},
    },
    "dra": {
        "config": {"resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}},
                   "dra": {"driver": "dra.example.com"}},
        "dra": {"claimTemplates": {"namespaces": ["default", "training"]}},
        "hostPaths": {"kubeletPlugins": "/data/kubelet/plugins"},
    },
    # DRA with the second scheduler: on 1.35+ its profile weighs DRA's score.
    "dra-scheduler": {
        "config": {"resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}}},
        "extender": {"enabled": True, "scheduler": {"enabled": True}},
    },
    # Device taints honoured by the cluster's scheduler (1.36+), and a 1.34
    # cluster told to use them anyway.
    "dra-1.36": {"config": {"resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}}}},
    "dra-taint-forced": {
        "config": {"resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}},
                   "dra": {"unhealthy": "taint"}},
    },
    "no-kube-proxy": {
        "kubernetesService": {"host": "10.0.0.10", "port": 6443},
        "hostPaths": {"kubeletConfig": "/var/lib/kubelet/config.yaml"},
        "extender": {"enabled": True, "hostNetwork": True},
    },
    "placement": {
        "nodeSelector": {"gpu.example.com/pool": "training"},
        "affinity": {"podAntiAffinity": {}},
        "runtimeClassName": "nvidia",
        "hostNetwork": True,
        "image": {"repository": "registry.example.com/devplugin", "tag": "1.2.3"},
    },
}  # fmt: skip
