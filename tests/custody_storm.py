"""A storm on one node: DRA claims and device-plugin pods at once.

Threads prepare and unprepare overlapping claims of the DRA resource
(calls to one claim serialized, as the kubelet does), while others admit
and remove pods asking for the device-plugin resource, events milliseconds
apart, with hooks of both kinds that take 0.05-1 s and sometimes fail.
Every grant and release the callers saw is kept as a Hold; the verdict is
custody_support.check over those and the hooks' own log.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from devplugin.testing.dra_kubelet import ClaimCall
from devplugin.testing.kubelet import AdmissionError, ContainerRequest, KubeletSimulator
from tests.custody_support import Hold

# What an answer must never say: a bug answered as an error.
BUGS = ("internal error", "Exception calling application", "StatusCode.UNKNOWN", "Traceback")


class Unreachable(Exception):
    """The plugin cannot be called now (between a kill and its restart's
    registration); the kubelet would ask again later."""


@dataclass
class StormLog:
    holds: list[Hold] = field(default_factory=list)
    answers: int = 0
    # The longest a DRA call took to be answered.
    worst: float = 0.0
    # Answers by what they said (the first words of an error, or "ok").
    outcomes: Counter[str] = field(default_factory=Counter)
    # What must never happen: a call past its deadline, an internal error.
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(
        self, asked: float, text: str, *, failure: bool = False, timed: bool = True
    ) -> None:
        """One answer. `timed`: it counts for the worst answer time (a pod's
        admission does not: it waits in the kubelet's own queue first)."""
        took = time.monotonic() - asked
        with self.lock:
            self.answers += 1
            if timed:
                self.worst = max(self.worst, took)
            self.outcomes[_kind_of(text)] += 1
            if failure or any(bug in text for bug in BUGS):
                self.failures.append(f"{took:.2f}s: {text[:300]}")

    def hold(self, hold: Hold) -> None:
        with self.lock:
            self.holds.append(hold)


def _kind_of(text: str) -> str:
    """An answer with its particulars (devices, claims, numbers) left out."""
    if not text:
        return "ok"
    text = re.sub(r"(device|claim) \S+", r"\1 X", text.split(":", 1)[0])
    return re.sub(r"[0-9.]+s\b", "Ns", text)[:70]


@dataclass
class _Claim:
    call: ClaimCall
    devices: tuple[str, ...]
    lock: threading.Lock = field(default_factory=threading.Lock)
    hold: Hold | None = None
    # The first attempt of a call that has not been answered yet (the
    # daemon died under it): the kubelet asks again until it is.
    asked: float | None = None
    releasing: bool = False


Prepare = Callable[[ClaimCall], dict[str, Any]]
Unprepare = Callable[[ClaimCall], dict[str, str]]


def rpc_text(exc: grpc.RpcError) -> str:
    call = exc if isinstance(exc, grpc.Call) else None
    code = call.code() if call is not None else None
    return f"{code}: {call.details() if call is not None else exc}"


def claim_actor(
    claims: list[_Claim],
    prepare: Prepare,
    unprepare: Unprepare,
    log: StormLog,
    *,
    until: float,
    rng: random.Random,
    tolerate_rpc_errors: bool,
) -> None:
    """Prepare or unprepare a random claim, over and over."""
    while time.monotonic() < until:
        claim = rng.choice(claims)
        if not claim.lock.acquire(blocking=False):
            continue
        try:
            _step(claim, prepare, unprepare, log, tolerate_rpc_errors)
        finally:
            claim.lock.release()
        time.sleep(rng.uniform(0, 0.03))


def _step(
    claim: _Claim, prepare: Prepare, unprepare: Unprepare, log: StormLog, tolerate: bool
) -> None:
    asked = time.monotonic()
    first = claim.asked if claim.asked is not None else asked
    try:
        if claim.hold is None:
            answer = prepare(claim.call)[claim.call.uid]
            error = answer["error"]
            log.answered(asked, error)
            claim.asked = None
            if not error:
                claim.hold = Hold(claim.call.name, claim.devices, first, time.monotonic())
                log.hold(claim.hold)
        else:
            if not claim.releasing:
                claim.hold.released = asked
                claim.releasing = True
            error = unprepare(claim.call)[claim.call.uid]
            log.answered(asked, error)
            if not error:
                claim.hold, claim.releasing = None, False
    except (grpc.RpcError, Unreachable) as exc:
        text = rpc_text(exc) if isinstance(exc, grpc.RpcError) else f"unreachable: {exc}"
        deadline = "DEADLINE_EXCEEDED" in text
        log.answered(asked, text, failure=deadline or not tolerate)
        if claim.hold is None:
            claim.asked = first  # asked again later, as the kubelet does


def pod_actor(
    kubelet: KubeletSimulator,
    resource: str,
    sizes: tuple[int, ...],
    log: StormLog,
    *,
    until: float,
    rng: random.Random,
    name: str,
) -> None:
    """Admit a pod, keep it a moment, remove it; over and over."""
    number = 0
    while time.monotonic() < until:
        number += 1
        pod = f"{name}-{number}"
        asked = time.monotonic()
        try:
            result = kubelet.admit(pod, [ContainerRequest("c", {resource: rng.choice(sizes)})])
        except AdmissionError as exc:
            deadline = exc.code is grpc.StatusCode.DEADLINE_EXCEEDED
            log.answered(asked, str(exc), failure=deadline, timed=False)
            time.sleep(rng.uniform(0.01, 0.05))
            continue
        log.answered(asked, "", timed=False)
        hold = Hold(pod, tuple(result.container("c").devices[resource]), asked, time.monotonic())
        log.hold(hold)
        time.sleep(rng.uniform(0, 0.4))
        hold.released = time.monotonic()
        kubelet.remove(pod)


def claims_over(
    names: list[str], ids: dict[str, str], make: Callable[..., ClaimCall]
) -> list[_Claim]:
    """One claim per device and one per pair of neighbours: every claim a
    device set of its own, overlapping its neighbours."""
    claims = []
    for index, name in enumerate(names):
        claims.append(_Claim(make(f"one-{index}", [("d", name)]), (ids[name],)))
        if len(names) > 2 or index == 0:
            other = names[(index + 1) % len(names)]
            claims.append(
                _Claim(make(f"two-{index}", [("d", name), ("e", other)]), (ids[name], ids[other]))
            )
    return claims


def run(actors: list[Callable[[], None]]) -> None:
    """Every actor on its own thread until all are done; the first exception
    any of them raised is raised here (a dead actor is a quieter storm)."""
    raised: list[BaseException] = []

    def guarded(actor: Callable[[], None]) -> None:
        try:
            actor()
        except Exception as exc:  # noqa: BLE001 - raised again by run, in the test thread
            raised.append(exc)

    threads = [
        threading.Thread(target=guarded, args=(actor,), name=f"storm-{i}")
        for i, actor in enumerate(actors)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if raised:
        raise raised[0]
