"""The scheduler extender over real HTTP, called with JSON shaped as the
kube-scheduler sends it, against NodeDevices records and pods in the API
server imitation."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from devplugin.config import KubernetesConfig
from devplugin.extender.app import serve
from devplugin.node.alignment import ContainerAlignment
from devplugin.policy.topology import Level
from devplugin.testing.apiserver import ApiServerImitation
from tests.extender_support import (
    GPU,
    HCA,
    Running,
    call,
    extender,
    inventory,
    lease,
    pod,
    put_record,
    synced,
)
from tests.waiting import wait_until

__all__ = ["extender"]


def test_node_names_form_filters_by_count_and_ranks_by_alignment(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    inv = inventory("hgx-h100", tmp_path / "ids")
    gpus = [g.uuid for g in inv.gpus]
    hcas = [h.device_id for h in inv.hcas]
    put_record(api, "empty", "hgx-h100", tmp_path)
    # Socket 0's GPUs are held, so 4 GPUs + 4 HCAs still sit together on socket 1.
    half = [ContainerAlignment("x", "a", "c", tuple(gpus[:4]), tuple(hcas[:4]), Level.PIX, 4)]
    put_record(api, "half", "hgx-h100", tmp_path, held=half)
    # Six GPUs held across both sockets: 2 free, too few for 4.
    full = [ContainerAlignment("x", "b", "c", tuple(gpus[:6]), (), None, None)]
    put_record(api, "busy", "hgx-h100", tmp_path, held=full)
    synced(extender, {"empty", "half", "busy"})
    args = {"Pod": pod("train", [{GPU: 4, HCA: 4}]), "NodeNames": ["empty", "half", "busy"]}
    code, result = call(extender, "filter", args)
    assert code == 200
    assert result["NodeNames"] == ["empty", "half"]
    assert set(result["FailedNodes"]) == {"busy"}
    assert "2 GPUs" in result["FailedNodes"]["busy"]
    assert result["FailedAndUnresolvableNodes"] == {}
    assert result["Error"] == ""
    code, ranked = call(extender, "prioritize", {**args, "NodeNames": ["empty", "half"]})
    assert code == 200
    scores = {entry["Host"]: entry["Score"] for entry in ranked}
    # Both give PIX; the half-used node keeps the empty one whole for 8-GPU jobs.
    assert scores["half"] == 10
    assert 0 < scores["empty"] < 10


def test_nodes_form_returns_the_passing_node_objects(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "a", "pcie-server", tmp_path)
    put_record(api, "b", "hgx-h100", tmp_path)
    synced(extender, {"a", "b"})
    nodes = {"metadata": {}, "items": [
        {"metadata": {"name": "a", "labels": {"x": "1"}}, "status": {}},
        {"metadata": {"name": "b"}, "spec": {"unschedulable": False}},
    ]}  # fmt: skip
    args = {"Pod": pod("big", [{GPU: 8, HCA: 8}]), "Nodes": nodes, "Unknown": True}
    code, result = call(extender, "filter", args)
    assert code == 200
    assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["b"]
    assert result["Nodes"]["items"][0] == nodes["items"][1]
    assert result["NodeNames"] is None
    # The PCIe server has fewer devices than that even when empty.
    assert set(result["FailedAndUnresolvableNodes"]) == {"a"}


def test_a_required_alignment_no_node_can_give_is_unresolvable_and_preferred_never_filters(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "h", "hgx-h100", tmp_path)  # 2 GPUs + 1 HCA: NODE at best here
    synced(extender, {"h"})
    required = pod(
        "p",
        [{GPU: 2, HCA: 1}],
        **{"devplugin.io/alignment": "PIX", "devplugin.io/alignment-policy": "required"},
    )
    code, result = call(extender, "filter", {"Pod": required, "NodeNames": ["h"]})
    assert code == 200
    assert result["NodeNames"] == []
    reason = result["FailedAndUnresolvableNodes"]["h"]
    assert "NODE" in reason
    assert "requires PIX" in reason
    preferred = pod("q", [{GPU: 2, HCA: 1}], **{"devplugin.io/alignment": "PIX"})
    code, result = call(extender, "filter", {"Pod": preferred, "NodeNames": ["h"]})
    assert result["NodeNames"] == ["h"]


def test_pods_without_devices_and_nodes_without_fresh_records_pass_and_score_zero(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "fresh", "hgx-h100", tmp_path)
    put_record(api, "old", "hgx-h100", tmp_path, age=3600)
    synced(extender, {"fresh", "old"})
    plain = pod("web", [{}])
    code, result = call(extender, "filter", {"Pod": plain, "NodeNames": ["fresh", "gone"]})
    assert (code, result["NodeNames"]) == (200, ["fresh", "gone"])
    args = {"Pod": pod("t", [{GPU: 8, HCA: 8}]), "NodeNames": ["fresh", "old", "gone"]}
    _, result = call(extender, "filter", args)
    assert result["NodeNames"] == ["fresh", "old", "gone"]
    code, ranked = call(extender, "prioritize", args)
    assert {e["Host"]: e["Score"] for e in ranked} == {"fresh": 10, "old": 0, "gone": 0}


def test_a_records_freshness_is_its_daemons_lease_not_its_last_write(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # Records are written only when they change: an old `updated` says nothing.
    put_record(api, "alive", "hgx-h100", tmp_path, age=3600)
    put_record(api, "dead", "hgx-h100", tmp_path, age=5)
    lease(api, "alive", age=2)
    lease(api, "dead", age=300)  # its daemon stopped renewing
    lease(api, "elsewhere", age=1, namespace="other")  # another namespace: not watched
    synced(extender, {"alive", "dead"})
    assert wait_until(lambda: {"alive", "dead"} <= set(extender[0].leases.items()), timeout=10)
    assert "elsewhere" not in extender[0].leases.items()
    args = {"Pod": pod("t", [{GPU: 2, HCA: 2}]), "NodeNames": ["alive", "dead"]}
    _code, ranked = call(extender, "prioritize", args)
    assert {e["Host"]: e["Score"] for e in ranked} == {"alive": 10, "dead": 0}
    lease(api, "dead", age=0)  # back
    assert wait_until(
        lambda: {e["Host"]: e["Score"] for e in call(extender, "prioritize", args)[1]}["dead"] > 0,
        timeout=5,
    )


def test_pods_bound_but_not_yet_in_the_record_take_their_devices_first(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "n", "hgx-h100", tmp_path)
    bound = pod("first", [{GPU: 6, HCA: 2}])
    bound["spec"]["nodeName"] = "n"
    api.put("pods", bound)
    synced(extender, {"n"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 1, timeout=10)
    _code, result = call(extender, "filter", {"Pod": pod("next", [{GPU: 4}]), "NodeNames": ["n"]})
    assert result["NodeNames"] == []
    # Of the same priority, "first" cannot be preempted: unresolvable.
    assert "2 GPUs" in result["FailedAndUnresolvableNodes"]["n"]
    urgent = pod("urgent", [{GPU: 4}])
    urgent["spec"]["priority"] = 1000
    _code, result = call(extender, "filter", {"Pod": urgent, "NodeNames": ["n"]})
    assert "2 GPUs" in result["FailedNodes"]["n"]


def test_a_bound_pod_asking_again_is_placed_without_itself_and_others_are_not(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    # A retry: the scheduler asks again about a pod already bound to "n".
    put_record(api, "n", "hgx-h100", tmp_path)
    put_record(api, "m", "hgx-h100", tmp_path)
    bound = pod("first", [{GPU: 6, HCA: 2}])
    bound["spec"]["nodeName"] = "n"
    uid = api.put("pods", bound)["metadata"]["uid"]
    synced(extender, {"n", "m"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 1, timeout=10)
    other = {"Pod": pod("second", [{GPU: 6, HCA: 2}]), "NodeNames": ["n", "m"]}
    again = pod("first", [{GPU: 6, HCA: 2}])
    again["metadata"]["uid"] = uid
    retry = {"Pod": again, "NodeNames": ["n", "m"]}
    # Asked first by another pod of the same shape: "n" is full for it.
    assert call(extender, "filter", other)[1]["NodeNames"] == ["m"]
    assert call(extender, "filter", retry)[1]["NodeNames"] == ["n", "m"]
    assert call(extender, "filter", other)[1]["NodeNames"] == ["m"]


@pytest.mark.parametrize("end", ["deleted", "finished", "replaced by a namesake"])
@pytest.mark.parametrize("uid_in_record", [True, False], ids=["with-uid", "by-name"])
def test_a_pod_the_watch_saw_end_holds_nothing_whatever_the_record_says(
    api: ApiServerImitation, tmp_path: Path, extender: Running, end: str, uid_in_record: bool
) -> None:
    inv = inventory("hgx-h100", tmp_path / "inv")
    gpus, hcas = [g.uuid for g in inv.gpus], [h.device_id for h in inv.hcas]
    holder = pod("old", [{GPU: 8, HCA: 8}])
    holder["spec"]["nodeName"] = "n"
    holder["status"]["phase"] = "Running"
    uid = api.put("pods", holder)["metadata"]["uid"]
    everything = [ContainerAlignment("default", "old", "c0", tuple(gpus), tuple(hcas), Level.PIX,
                                     8, uid if uid_in_record else None)]  # fmt: skip
    put_record(api, "n", "hgx-h100", tmp_path, held=everything)
    synced(extender, {"n"})
    assert wait_until(lambda: len(extender[0].pods.pods()) == 1, timeout=10)
    args = {"Pod": pod("next", [{GPU: 2, HCA: 2}]), "NodeNames": ["n"]}
    _code, result = call(extender, "filter", args)
    assert result["NodeNames"] == []
    # The record is not rewritten: only the pod watch says the holder is gone.
    if end == "deleted":
        api.remove("pods", "old", "default")
    elif end == "finished":
        api.set_status("pods", "old", "default", {"phase": "Succeeded"})
    else:
        api.remove("pods", "old", "default")
        namesake = pod("old", [{GPU: 1, HCA: 1}])
        namesake["metadata"]["uid"] = "uid-namesake"
        namesake["spec"]["nodeName"] = "n"
        api.put("pods", namesake)

    def passes() -> bool:
        return call(extender, "filter", args)[1]["NodeNames"] == ["n"]

    if end == "replaced by a namesake" and not uid_in_record:
        # By name alone the record may mean the live namesake: believed.
        assert wait_until(lambda: "uid-namesake" in extender[0].pods.pods(), timeout=5)
        assert not passes()
        return
    assert wait_until(passes, timeout=5)
    _code, ranked = call(extender, "prioritize", args)
    assert ranked == [{"Host": "n", "Score": 10}]
    if end == "replaced by a namesake":
        # The namesake is a new pod bound here, placed first: 1 + 8 > 8.
        big = {"Pod": pod("big", [{GPU: 8, HCA: 8}]), "NodeNames": ["n"]}
        assert call(extender, "filter", big)[1]["NodeNames"] == []


def test_a_prioritize_after_a_filter_reads_the_answers_the_filter_kept(
    api: ApiServerImitation, tmp_path: Path, extender: Running
) -> None:
    put_record(api, "n", "hgx-h100", tmp_path)
    put_record(api, "m", "pcie-server", tmp_path)
    synced(extender, {"n", "m"})
    args = {"Pod": pod("t", [{GPU: 4, HCA: 2}]), "NodeNames": ["n", "m"]}
    memo = extender[0].metrics.memo
    call(extender, "filter", args)
    hits = memo.labels("hit")._value.get()
    misses = memo.labels("miss")._value.get()
    views = extender[0].views
    looked: list[object] = []
    outcomes = views.outcomes
    views.outcomes = lambda *a, **k: looked.append(a) or outcomes(*a, **k)  # type: ignore[method-assign]
    # The same cycle: both nodes' answers kept, no view asked again.
    _, kept = call(extender, "prioritize", args)
    assert memo.labels("hit")._value.get() == hits + 2
    assert memo.labels("miss")._value.get() == misses
    # Another pod of the same shape, never filtered: the same kept answers
    # (once `t` is bound elsewhere: until then its prioritize answer holds
    # its room on n in other pods' rankings, test_extender_holds.py).
    extender[0].holds.pod_changed("uid-t", None, None)
    other = {"Pod": pod("u", [{GPU: 4, HCA: 2}]), "NodeNames": ["n", "m"]}
    _, fresh = call(extender, "prioritize", other)
    assert memo.labels("hit")._value.get() == hits + 4
    assert memo.labels("miss")._value.get() == misses
    assert looked == []
    assert fresh == kept
    assert {entry["Score"] for entry in kept} != {0}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"NodeNames": ["a"]}', "Pod"),
        (
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d"}, "spec": {}}, "NodeNames": "a"}',
            "NodeNames",
        ),
        (
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d"}, "spec": {}}}',
            "NodeNames or Nodes",
        ),
        (
            b'{"Pod": {"metadata": {"name": "p", "namespace": "d", "annotations": '
            b'{"devplugin.io/alignment": "SYS"}}, "spec": {}}, "NodeNames": []}',
            "alignment",
        ),
    ],
)
def test_malformed_bodies_get_400_with_a_reason_and_the_service_keeps_serving(
    api: ApiServerImitation, tmp_path: Path, extender: Running, raw: bytes, reason: str
) -> None:
    code, answer = call(extender, "filter", None, raw=raw)
    assert code == 400
    assert reason in answer["Error"]
    code, answer = call(extender, "filter", {"Pod": pod("ok", [{}]), "NodeNames": ["x"]})
    assert (code, answer["NodeNames"]) == (200, ["x"])


def test_health_readiness_and_metrics(extender: Running) -> None:
    host, port = extender[1].address
    assert wait_until(lambda: extender[0].ready()[0], timeout=10)
    for path, expected in (
        ("/healthz", b"ok"),
        ("/readyz", b"ok"),
        ("/metrics", b"devplugin_extender_records"),
    ):
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as answer:
            assert answer.status == 200
            assert expected in answer.read()


def test_the_extender_serves_https_with_the_given_certificate(
    api: ApiServerImitation, tmp_path: Path
) -> None:
    import shutil
    import ssl
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(api.kubeconfig()))
    kube = KubernetesConfig(enabled=True, kubeconfig=str(kubeconfig))
    running = serve(kube, ("127.0.0.1", 0), stale_after=60.0, tls=(str(cert), str(key)))
    try:
        host, port = running[1].address
        context = ssl.create_default_context(cafile=str(cert))
        body = json.dumps({"Pod": pod("web", [{}]), "NodeNames": ["a"]}).encode()
        request = urllib.request.Request(
            f"https://{host}:{port}/scheduler/filter",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            assert json.loads(answer.read())["NodeNames"] == ["a"]
        # Plain HTTP gets nowhere; the server keeps serving TLS afterwards.
        with pytest.raises(
            (ConnectionResetError, urllib.error.URLError, http.client.HTTPException)
        ):
            urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=5)
        with urllib.request.urlopen(
            f"https://{host}:{port}/healthz", timeout=10, context=context
        ) as answer:
            assert answer.status == 200
    finally:
        running[1].stop()
        for cache in running[2]:
            cache.signal_stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--listen", "nowhere"], "--listen"),
        (["--listen", "127.0.0.1:1", "--tls-cert", "x.pem"], "--tls-cert and --tls-key"),
        (["--listen", "127.0.0.1:1", "--stale-after-seconds", "0"], "--stale-after-seconds"),
    ],
)
def test_bad_extender_flags_exit_two_with_one_line(flags: list[str], message: str) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "devplugin", "extender", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert message in lines[0]
