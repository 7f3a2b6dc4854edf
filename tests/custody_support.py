"""What custody promises, checked from the outside: the hooks' own log and
what the callers (the kubelet simulators) were told, never the daemon's state.

A hold is one holder's time with a device, as its caller knows it: it was
asked for at `asked`, granted at `granted` (the answer came back) and given
back at `released` (the start of the release call: an unprepare, or the
kubelet removing the pod), or still held. The init hook of a hold ran
between asking and granting; from its start the device is in use.

The rules, per device:
- no two holds overlap;
- no cleanup hook runs while the device is in use (from a hold's init
  until its release);
- no init hook starts while another holder has the device;
- between any two init hooks (two uses), a cleanup hook succeeded that
  started after the first use ended (its release, or the end of an init
  that failed or was cut short) and ended before the second began.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path


@dataclass
class HookRun:
    phase: str
    devices: tuple[str, ...]
    pid: int
    start: float
    end: float | None = None
    ok: bool | None = None
    # The process that started it.
    parent: int = 0

    def finish(self, horizon: float) -> float:
        """When it stopped: its own end, else `horizon` (a killed hook is
        known dead by then)."""
        return self.end if self.end is not None else horizon


@dataclass
class Hold:
    holder: str
    devices: tuple[str, ...]
    asked: float
    granted: float
    released: float | None = None


@dataclass
class Report:
    violations: list[str] = field(default_factory=list)
    holds: int = 0
    inits: int = 0
    cleanups: int = 0
    reuses: int = 0


def hook_runs(*logs: Path) -> list[HookRun]:
    """Every run in these hook logs (hook_helper.py's lines). A log is read
    in order: an end line closes the run its pid has open in the same log
    (pids are reused; a run whose pid starts again had been killed)."""
    runs: list[HookRun] = []
    for log in logs:
        if not log.exists():
            continue
        text = log.read_text()
        open_runs: dict[int, HookRun] = {}
        # A line not yet ended with a newline is a hook writing it right now.
        for line in text[: text.rfind("\n") + 1].splitlines():
            entry = json.loads(line)
            if "stdin" in entry:
                ids = entry["env"]["DEVPLUGIN_DEVICE_IDS"]
                run = HookRun(
                    entry["env"]["DEVPLUGIN_HOOK"],
                    tuple(ids.split(",")) if ids else (),
                    entry["pid"],
                    entry["start"],
                    parent=entry.get("ppid", 0),
                )
                open_runs[run.pid] = run
                runs.append(run)
            elif "end" in entry and entry["pid"] in open_runs:
                run = open_runs.pop(entry["pid"])
                run.end, run.ok = entry["end"], entry.get("ok", True)
    return sorted(runs, key=lambda run: run.start)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


Use = tuple[Hold, float, HookRun | None]


def _uses(
    holds: Iterable[Hold], inits: Mapping[str, list[HookRun]], report: Report
) -> dict[str, list[Use]]:
    """Each device's holds, each with when its use began and its init.

    Each hold's init: in the order holds were granted, the latest init of
    exactly its devices begun while it was asked for that no earlier hold
    took (a pod's asking includes waiting in the kubelet's admission queue,
    through other pods' inits; the storms give every holder its own set)."""
    by_device: dict[str, list[Use]] = defaultdict(list)
    taken: set[int] = set()
    for hold in sorted(holds, key=lambda hold: hold.granted):
        report.holds += 1
        first = hold.devices[0] if hold.devices else ""
        mine = [
            r for r in inits.get(first, [])
            if hold.asked <= r.start <= hold.granted and set(r.devices) == set(hold.devices)
            and id(r) not in taken
        ]  # fmt: skip
        init = mine[-1] if mine else None
        if init is not None:
            taken.add(id(init))
        for device in hold.devices:
            by_device[device].append((hold, init.start if init else hold.granted, init))
    return by_device


def check(runs: Sequence[HookRun], holds: Iterable[Hold], *, horizon: float) -> Report:
    """The rules above over one node's runs and holds. `horizon`: by then
    every run without an end of its own had been stopped."""
    report = Report()
    inits: dict[str, list[HookRun]] = defaultdict(list)
    cleanups: dict[str, list[HookRun]] = defaultdict(list)
    for run in runs:
        for device in run.devices:
            (inits if run.phase == "init" else cleanups)[device].append(run)
    report.inits = sum(len(v) for v in inits.values())
    report.cleanups = sum(len(v) for v in cleanups.values())
    by_device = _uses(holds, inits, report)
    for device, entries in sorted(by_device.items()):
        entries.sort(key=lambda entry: entry[1])
        spans = [(since, hold.released or math.inf) for hold, since, _ in entries]
        for ((hold, _, _), a), ((other, _, _), b) in pairwise(zip(entries, spans, strict=True)):
            if _overlap(a, b):
                report.violations.append(
                    f"{device}: held by {hold.holder} and {other.holder} at once "
                    f"({a[0]:.3f}-{a[1]:.3f} and {b[0]:.3f}-{b[1]:.3f})"
                )
        for run in cleanups[device]:
            ran = (run.start, run.finish(horizon))
            for (hold, _, _), span in zip(entries, spans, strict=True):
                if _overlap(ran, span):
                    report.violations.append(
                        f"{device}: cleanup (pid {run.pid}, {ran[0]:.3f}-{ran[1]:.3f}) while "
                        f"{hold.holder} held it ({span[0]:.3f}-{span[1]:.3f})"
                    )
        for run in inits[device]:
            for (hold, _, init), span in zip(entries, spans, strict=True):
                if init is not run and span[0] <= run.start < span[1]:
                    report.violations.append(
                        f"{device}: init (pid {run.pid}) at {run.start:.3f} while {hold.holder} "
                        f"held it ({span[0]:.3f}-{span[1]:.3f})"
                    )
        # Each use ends at its hold's release, or (no hold: the prepare or
        # Allocate failed, or the daemon died) when its init stopped.
        ends = {
            id(init): span[1] for (_, _, init), span in zip(entries, spans, strict=True) if init
        }
        uses = inits[device]
        for first, second in pairwise(uses):
            report.reuses += 1
            after = ends.get(id(first), first.finish(horizon))
            if after == math.inf:
                continue  # still held: the second init is the violation above
            if not any(
                c.ok and c.end is not None and c.start > after and c.end <= second.start
                for c in cleanups[device]
            ):
                report.violations.append(
                    f"{device}: used again at {second.start:.3f} (init pid {second.pid}) with no "
                    f"cleanup begun after the previous use ended at {after:.3f}"
                )
    return report
