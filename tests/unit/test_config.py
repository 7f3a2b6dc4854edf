"""Configuration: versioned, strict, one-line errors naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from devplugin.config import (
    Config,
    ConfigError,
    dra_cdi_kind,
    dra_kinds,
    load_config,
    override,
    parse_config,
)


def test_defaults() -> None:
    config = parse_config({"version": "v1"})
    assert config == Config()
    assert config.resources.gpu.name == "nvidia.com/gpu"
    assert config.resources.hca.name == "rdma/hca"
    assert config.resources.hca.env_var == "NCCL_IB_HCA"
    assert config.paths.sysfs_root == "/sys"
    assert config.paths.dev_root == "/dev"
    assert config.paths.device_plugin_dir == "/var/lib/kubelet/device-plugins"
    assert config.paths.pod_resources_socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert config.nvml.fixture is None


def test_a_full_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        """
version: v1
resources:
  gpu: {name: example.com/gpu}
  hca: {name: example.com/hca, env_var: MY_HCAS}
paths:
  sysfs_root: /host/sys
  dev_root: /host/dev
discovery:
  rescan_interval_seconds: 2
logging:
  format: json
"""
    )
    config = load_config(path)
    assert config.resources.gpu.name == "example.com/gpu"
    assert config.resources.hca.env_var == "MY_HCAS"
    assert config.paths.sysfs_root == "/host/sys"
    assert config.discovery.rescan_interval_seconds == 2.0
    assert config.logging.format == "json"
    assert config.paths.device_plugin_dir == "/var/lib/kubelet/device-plugins"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({}, "version: missing"),
        ({"version": "v2"}, "version: unsupported version 'v2'"),
        ({"version": "v1", "colour": 1}, "colour: unknown key"),
        (
            {"version": "v1", "resources": {"gpu": {"nmae": "x/y"}}},
            "resources.gpu.nmae: unknown key",
        ),
        ({"version": "v1", "resources": {"gpu": {"name": "gpu"}}}, "resources.gpu.name: must be"),
        (
            {"version": "v1", "resources": {"gpu": {"name": "kubernetes.io/gpu"}}},
            "resources.gpu.name: the kubernetes.io domain is reserved",
        ),
        (
            {"version": "v1", "resources": {"gpu": {"enabled": "yes"}}},
            "resources.gpu.enabled: must be a boolean, got str",
        ),
        (
            {"version": "v1", "resources": {"hca": {"name": "nvidia.com/gpu"}}},
            "resources.hca.name: same as the GPU resource name",
        ),
        (
            {"version": "v1", "resources": {"hca": {"env_var": "NCCL-IB"}}},
            "resources.hca.env_var: must be an environment variable name",
        ),
        ({"version": "v1", "resources": "all"}, "resources: must be a mapping, got str"),
        (
            {"version": "v1", "paths": {"sysfs_root": "sys"}},
            "paths.sysfs_root: must be an absolute path",
        ),
        (
            {"version": "v1", "discovery": {"rescan_interval_seconds": 0}},
            "discovery.rescan_interval_seconds: must be greater than 0",
        ),
        (
            {"version": "v1", "discovery": {"rescan_interval_seconds": True}},
            "discovery.rescan_interval_seconds: must be a number, got bool",
        ),
        (
            {"version": "v1", "logging": {"format": "xml"}},
            "logging.format: must be one of 'text', 'json'",
        ),
        (
            {"version": "v1", "resources": {"gpu": {"enabled": False}, "hca": {"enabled": False}}},
            "resources: every resource is disabled",
        ),
        (
            {"version": "v1", "resources": {"gpu": {"hooks": {"init": "reset-gpu --all"}}}},
            "resources.gpu.hooks.init: must be a list",
        ),
        (
            {"version": "v1", "resources": {"hca": {"hooks": {"cleanup": ["x", ""]}}}},
            "resources.hca.hooks.cleanup: every argument must be a non-empty string",
        ),
        (
            {"version": "v1", "resources": {"hca": {"hooks": {"init_phase": "later"}}}},
            "resources.hca.hooks.init_phase: must be one of 'allocate', 'pre_start'",
        ),
        (
            {"version": "v1", "health": {"recovery": "after_cleanup"}},
            "resources.gpu.hooks.cleanup: health.recovery after_cleanup needs a cleanup hook",
        ),
        (
            {"version": "v1", "health": {"xid_ignore": [13, 0]}},
            "health.xid_ignore: XIDs are integers from 1 to 999",
        ),
        ({"version": "v1", "health": {"good_checks": 0}}, "health.good_checks: must be at least 1"),
        (
            {"version": "v1", "lifecycle": {"checkpoint_file": "state.json"}},
            "lifecycle.checkpoint_file: must be an absolute path",
        ),
        (
            {"version": "v1", "resources": {"gpu": {"api": "grpc"}}},
            "resources.gpu.api: must be one of 'device-plugin', 'dra'",
        ),
        (
            {"version": "v1", "resources": {"hca": {"api": "dra"}}},
            "resources.hca.api: dra needs kubernetes.enabled",
        ),
        (
            {"version": "v1", "dra": {"driver": "DevPlugin.io"}},
            "dra.driver: must be a lowercase DNS subdomain",
        ),
        (
            {"version": "v1", "dra": {"driver": "a" * 64}},
            "dra.driver: must be a lowercase DNS subdomain of at most 63 characters",
        ),
        ({"version": "v1", "dra": {"cdi_kind": "claim"}}, "dra.cdi_kind: must be vendor/class"),
        (
            {"version": "v1", "dra": {"unhealthy": "drop"}},
            "dra.unhealthy: must be one of 'taint', 'remove'",
        ),
        (
            {"version": "v1", "paths": {"kubelet_registry_dir": "plugins_registry"}},
            "paths.kubelet_registry_dir: must be an absolute path",
        ),
        (
            {
                "version": "v1",
                "kubernetes": {"enabled": True},
                "resources": {
                    "gpu": {"api": "dra", "hooks": {"init": ["x"], "init_phase": "pre_start"}}
                },
            },
            "resources.gpu.hooks.init_phase: pre_start is a Device Plugin API call",
        ),
        (
            {
                "version": "v1",
                "kubernetes": {"enabled": True},
                "resources": {"gpu": {"api": "dra"}},
                "sharing": {"gpu": {"replicas": 4}},
            },
            "sharing.gpu.replicas: time-slicing is not offered through dra",
        ),
        (
            {
                "version": "v1",
                "kubernetes": {"enabled": True},
                "resources": {"hca": {"api": "dra"}},
                "sharing": {"hca": {"units": 2}},
            },
            "sharing.hca.units: shared HCAs are not offered through dra",
        ),
        (
            {
                "version": "v1",
                "kubernetes": {"enabled": True},
                "resources": {"gpu": {"api": "dra"}},
                "allocation": {"attach_hcas": True},
            },
            "allocation.attach_hcas: not with resources.gpu.api dra",
        ),
    ],
)
def test_bad_config_names_the_field(data: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert str(info.value).startswith(message), str(info.value)
    assert "\n" not in str(info.value)


def test_hooks_are_read_as_argv_lists(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        """
version: v1
resources:
  gpu:
    hooks:
      init: [/usr/bin/gpu-init, --quiet]
      cleanup: [python3, -m, devplugin.hooks.gpu_cleanup]
      timeout_seconds: 30
      init_phase: pre_start
  hca:
    hooks:
      cleanup: [python3, -m, devplugin.hooks.hca_check]
health:
  recovery: after_cleanup
  xid_ignore: [13, 43]
"""
    )
    config = load_config(path)
    hooks = config.resources.gpu.hooks
    assert hooks.init == ("/usr/bin/gpu-init", "--quiet")
    assert hooks.cleanup == ("python3", "-m", "devplugin.hooks.gpu_cleanup")
    assert hooks.timeout_seconds == 30.0
    assert hooks.init_phase == "pre_start"
    assert config.resources.hca.hooks.cleanup[-1] == "devplugin.hooks.hca_check"
    assert config.health.recovery == "after_cleanup"
    assert config.health.xid_ignore == (13, 43)


def test_yaml_syntax_error_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("version: v1\nresources: [\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "line" in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_overrides_replace_nested_fields_and_are_validated() -> None:
    config = override(Config(), **{"paths.dev_root": "/host/dev", "nvml.fixture": None})
    assert config.paths.dev_root == "/host/dev"
    assert config.nvml.fixture is None
    with pytest.raises(ConfigError, match=r"^paths.dev_root: must be an absolute path"):
        override(Config(), **{"paths.dev_root": "dev"})
    with pytest.raises(ConfigError, match=r"^paths.nope: unknown key"):
        override(Config(), **{"paths.nope": "/x"})


def test_dra_settings_and_their_derived_paths() -> None:
    config = parse_config(
        {
            "version": "v1",
            "kubernetes": {"enabled": True},
            "resources": {"gpu": {"api": "dra"}, "hca": {"api": "dra"}},
            "paths": {"kubelet_plugins_dir": "/k/plugins"},
        }
    )
    assert dra_kinds(config) == {"gpu", "hca"}
    assert config.dra.driver == "devplugin.io"
    assert dra_cdi_kind(config) == "k8s.devplugin.io/claim"
    assert config.paths.kubelet_registry_dir == "/var/lib/kubelet/plugins_registry"
    mixed = override(config, **{"resources.hca.api": "device-plugin", "dra.driver": "x.example"})
    assert dra_kinds(mixed) == {"gpu"}
    assert dra_cdi_kind(mixed) == "k8s.x.example/claim"
    # A disabled resource is served neither way.
    assert dra_kinds(override(mixed, **{"resources.gpu.enabled": False})) == frozenset()
    assert dra_kinds(parse_config({"version": "v1"})) == frozenset()
