"""SchedulerParts: what the scheduler's policy objects share."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from orchestrator.core.config import MFSConfig
from orchestrator.core.events import EventLog, Stats
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool
from orchestrator.core.request_queue import RunningSet, WaitingQueue
from orchestrator.core.tiers import TieredStore


class StepScope:
    """The members a step's plan may touch (None: every member). A runner stepping members on devices of their own
    narrows it to one device's members before it asks for that device's plan, so the plan never touches a request
    that may be in a step in flight on another device."""

    __slots__ = ("members",)

    def __init__(self, members: Collection[str] | None = None) -> None:
        self.members = members


@dataclass(frozen=True, slots=True)
class SchedulerParts:
    family: FamilySpec
    config: MFSConfig
    pool: PagePool
    kv: KVCacheManager
    tiers: TieredStore | None
    running: RunningSet
    waiting: WaitingQueue
    # most pages each member can ever hold: a request needing more is refused at once, not left waiting
    capacity_pages: dict[str, int]
    events: EventLog
    stats: Stats
    scope: StepScope
