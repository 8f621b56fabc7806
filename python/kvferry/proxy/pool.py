"""The instances of one role (prefill or decode): outstanding requests and whether each is up.

Pure bookkeeping, one event loop: no I/O here. The proxy sends each leg to the instance of its
role with the fewest outstanding legs among those up (ties rotate, so sequential requests spread);
a failed connection takes an instance out at once, and the health checker (health.py) takes
instances out after repeated failed checks and puts them back after one good one.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Iterable, Optional

from .config import InstanceConfig

logger = logging.getLogger("kvferry.proxy")


@dataclass(eq=False)
class Instance:
    config: InstanceConfig
    role: str
    outstanding: int = 0
    up: bool = True
    failed_checks: int = 0

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
        candidates = [i for i in self.instances if i.up and id(i) not in skip
                      and (i.config.connector is not None or not need_connector)]
        if not candidates:
            return None
        least = min(i.outstanding for i in candidates)
        tied = [i for i in candidates if i.outstanding == least]
        return tied[next(self._turn) % len(tied)]

    def up_count(self) -> int:
        return sum(1 for i in self.instances if i.up)

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
