"""SchedulerParts: what the scheduler's policy objects share (family, config, pool, KV, tiers, queues, event log)."""
from __future__ import annotations

from dataclasses import dataclass

from orchestrator.core.config import MFSConfig
from orchestrator.core.events import EventLog, Stats
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool
from orchestrator.core.request_queue import RunningSet, WaitingQueue
from orchestrator.core.tiers import TieredStore


@dataclass(frozen=True, slots=True)
class SchedulerParts:
    family: FamilySpec
    config: MFSConfig
    pool: PagePool
    kv: KVCacheManager
    tiers: TieredStore | None
    running: RunningSet
    waiting: WaitingQueue
    # Most pages each member can ever hold (its slice, minus the other members' floors, under its ceiling):
    # a request needing more is refused at once rather than left waiting for room that never comes.
    capacity_pages: dict[str, int]
    events: EventLog
    stats: Stats
