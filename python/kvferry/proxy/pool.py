"""The instances of one role (prefill or decode): outstanding requests, whether each is up, and
whether it takes new legs.

Pure bookkeeping, one event loop: no I/O here. The proxy sends each leg to the instance of its
role with the fewest outstanding legs among those up and serving (ties rotate, so sequential
requests spread); a failed connection takes an instance out at once, and the health checker
(health.py) takes instances out after repeated failed checks and puts them back after one good
one. Membership changes at run time (the admin API, etcd discovery: docs/fleet.md): an instance
added takes legs at once; one draining or removed takes no new legs, and the legs it has in
flight finish (they hold their Instance).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

from .config import InstanceConfig

logger = logging.getLogger("kvferry.proxy")


SERVING, DRAINING = "serving", "draining"
STATES = (SERVING, DRAINING)


@dataclass(eq=False)
class Instance:
    config: InstanceConfig
    role: str
    outstanding: int = 0
    up: bool = True
    failed_checks: int = 0
    state: str = SERVING
    # Where it came from: "static" (flags or file), "admin" (the admin API), "etcd".
    source: str = "static"

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url


class Pool:
    def __init__(self, role: str, configs: Iterable[InstanceConfig]):
        self.role = role
        self.instances = [Instance(c, role) for c in configs]
        self._turn = itertools.count()

    def pick(self, exclude: Iterable[Instance] = (), need_connector: bool = False
             ) -> Optional[Instance]:
        """The up instance with the fewest outstanding legs, not in `exclude` (and with a
        connector endpoint when `need_connector`); None when there is none."""
        skip = set(map(id, exclude))
        candidates = [i for i in self.instances if i.up and i.state == SERVING
                      and id(i) not in skip
                      and (i.config.connector is not None or not need_connector)]
        if not candidates:
            return None
        least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def up_count(self) -> int:
        return sum(1 for i in self.instances if i.up and i.state == SERVING)

    def find(self, name: str) -> Optional[Instance]:
        return next((i for i in self.instances if i.name == name), None)

    def add(self, config: InstanceConfig, source: str, state: str = SERVING) -> Instance:
        """Adds an instance, or updates the one of that name (its URL, connector and state; its
        legs in flight are kept). Returns it."""
        if state not in STATES:
            raise ValueError(f"state: expected one of {STATES}, found {state!r}")
        inst = self.find(config.name)
        if inst is None:
            inst = Instance(config, self.role, state=state, source=source)
            self.instances.append(inst)
            logger.info("%s instance %s (%s) added (%s, %s)", self.role, inst.name, inst.url,
                        source, state)
            return inst
        if (inst.config, inst.state) != (config, state):
            logger.info("%s instance %s (%s) updated (%s, %s)", self.role, inst.name,
                        config.url, source, state)
        if inst.config.url != config.url:  # another process: up until its checks say otherwise
            inst.up, inst.failed_checks = True, 0
        inst.config, inst.state, inst.source = config, state, source
        return inst

    def drain(self, name: str) -> Optional[Instance]:
        """No new legs go to the instance; those in flight finish. None when it is unknown."""
        inst = self.find(name)
        if inst is not None and inst.state != DRAINING:
            inst.state = DRAINING
            logger.info("%s instance %s (%s) draining: %d legs in flight", self.role, inst.name,
                        inst.url, inst.outstanding)
        return inst

    def remove(self, name: str) -> Optional[Instance]:
        """Takes the instance out of the pool (its legs in flight finish). None when unknown."""
        inst = self.find(name)
        if inst is not None:
            self.instances.remove(inst)
            logger.info("%s instance %s (%s) removed: %d legs in flight", self.role, inst.name,
                        inst.url, inst.outstanding)
        return inst

    def mark_down(self, instance: Instance, why: str) -> None:
        if instance.up:
            logger.warning("%s instance %s (%s) taken out: %s", self.role, instance.name,
                           instance.url, why)
        instance.up = False

    def mark_up(self, instance: Instance) -> None:
        if not instance.up:
            logger.info("%s instance %s (%s) is back", self.role, instance.name, instance.url)
        instance.up = True
        instance.failed_checks = 0
