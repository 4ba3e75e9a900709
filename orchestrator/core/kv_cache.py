"""KV cache facade over the page pool: per-request per-layer block tables, prefix match across tiers, allocation.

The block geometry is KVLayout's (kv_layout.py). Prefix identity is PageKey(lineage, block_hash), so members of a
nested family find each other's lower-layer pages; independent members never do.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from orchestrator.core.block_hash import chain_block_hashes, hash_seed
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_layout import KVLayout
from orchestrator.core.page_pool import PagePool
from orchestrator.core.tiers import TieredStore
from orchestrator.core.types import PageId, PageKey, Tier


# One page slot of a request's tables: (kind "kv" | "out" | "in", layer or None, block, key or None = fresh).
_Slot = tuple[str, int | None, int, PageKey | None]


@dataclass(slots=True)
class PrefixMatch:
    """What a member already holds of a prompt, in full blocks (read-only result of a match)."""

    member: str
    tokens_per_block: int
    num_full_blocks: int = 0                 # every layer present (arena or a tier)
    num_shared_blocks: int = 0               # next blocks: layers < shared_depth and the residual present
    shared_depth: int = 0                    # 0 = no partial-layer reuse
    shared_source: str | None = None         # member whose residuals feed the handover
    tier_blocks: dict[Tier, int] = field(default_factory=dict)  # full blocks by the slowest tier they need

    @property
    def num_full_tokens(self) -> int:
        return self.num_full_blocks * self.tokens_per_block

    @property
    def num_shared_tokens(self) -> int:
        return self.num_shared_blocks * self.tokens_per_block


@dataclass(slots=True)
class SeqKV:
    """One request's pages on its current member."""

    member: str
    tokens_per_block: int
    block_tables: list[list[PageId]]                      # [layer][block]
    residual_out: list[PageId] | None = None              # [block]: exit-depth residual pages this member writes
    residual_in: dict[int, PageId] = field(default_factory=dict)  # block -> residual page feeding a handover
    num_registered_blocks: int = 0
    # The pool member its pages are allocated as (None: `member`): a draft's pages come from its target's slice
    # when each server keeps its own draft (Speculation's private drafts)
    account: str | None = None
    # The tables cut to the first n blocks as the last chunk got them (n, tables, residual_out): a decoding
    # request asks for the same n for tokens_per_block steps in a row, and copying 28-36 layer tables per
    # token was the simulator's top cost. Valid while the live tables keep their first n pages: they only
    # grow at the end, and release() replaces them (and drops this).
    _view: tuple[int, list[list[PageId]], list[PageId] | None] | None = field(
        default=None, init=False, repr=False, compare=False)
    # (pool sharing epoch, num_pages, private pages) when last counted: see KVCacheManager.num_private_pages
    _private: tuple[int, int, int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_tables[0])

    def tables_upto(self, num_blocks: int) -> tuple[list[list[PageId]], list[PageId] | None]:
        """The block tables and residual_out of the first num_blocks blocks: copies the chunk may keep (the
        core never changes them), shared between the steps that read the same number of blocks."""
        view = self._view
        if view is None or view[0] != num_blocks:
            residual = self.residual_out[:num_blocks] if self.residual_out is not None else None
            view = (num_blocks, [table[:num_blocks] for table in self.block_tables], residual)
            self._view = view
        return view[1], view[2]

    def num_pages(self) -> int:
        # Every layer's table has one page per block (attach lays out whole blocks, grow adds whole blocks).
        return len(self.block_tables[0]) * len(self.block_tables) + len(self.residual_out or ()) + len(self.residual_in)

    def all_pages(self) -> list[PageId]:
        pages = list(chain.from_iterable(self.block_tables))
        pages.extend(self.residual_out or ())
        pages.extend(self.residual_in.values())
        return pages


class KVCacheManager:
    def __init__(self, family: FamilySpec, pool: PagePool, page_bytes: int, dtype_bytes: int,
                 tiers: TieredStore | None = None, record_residuals: bool = True):
        self.family = family
        self.pool = pool
        self.tiers = tiers
        self.layout = KVLayout(family, page_bytes, dtype_bytes, record_residuals)
        self._blocks: dict[str, int] = {m.name: self.layout.tokens_per_block(m.name) for m in family.members}

    # ------------------------------------------------------------------ identity (the layout's rules)
    def tokens_per_block(self, member: str) -> int:
        return self._blocks[member]

    def pages_per_block(self, member: str) -> int:
        return self.layout.pages_per_block(member)

    def pages_for_tokens(self, member: str, num_tokens: int) -> int:
        """Pages a sequence of num_tokens holds on member: KVLayout.pages_for_tokens, the one rule."""
        return self.layout.pages_for_tokens(member, num_tokens)

    def block_hashes(self, member: str, token_ids: list[int], cache_salt: str | None,
                     known: list[bytes] | None = None) -> list[bytes]:
        """Chained hashes of the full blocks of token_ids; extends `known` instead of recomputing."""
        spec = self.family.member(member)
        known = list(known or ())
        parent = known[-1] if known else None
        seed = hash_seed(spec.tokenizer_hash, cache_salt)
        known.extend(chain_block_hashes(token_ids, self._blocks[member], seed, parent=parent, start_block=len(known)))
        return known

    def _locate(self, key: PageKey) -> Tier | None:
        if self.pool.lookup(key) is not None:
            return Tier.ARENA
        return self.tiers.locate(key) if self.tiers is not None else None

    # ------------------------------------------------------------------ matching
    def match(self, member: str, hashes: list[bytes], num_tokens: int, allow_shared: bool = True) -> PrefixMatch:
        """Exact per-layer match. Leaves at least one token to compute (its logits start decoding)."""
        spec = self.family.member(member)
        size = self._blocks[member]
        limit = min(len(hashes), max(0, (num_tokens - 1) // size))
        result = PrefixMatch(member=member, tokens_per_block=size)
        block = 0
        while block < limit:
            slowest = self._block_tier(spec.layer_lineages, hashes[block])
            if slowest is None:
                break
            result.tier_blocks[slowest] = result.tier_blocks.get(slowest, 0) + 1
            block += 1
        result.num_full_blocks = block
        if not allow_shared:
            return result
        for source in self.layout.residual_sources[member]:
            lineages = source.layer_lineages + (source.residual_lineage(),)
            shared = block
            while shared < limit and self._block_tier(lineages, hashes[shared]) is not None:
                shared += 1
            if shared > block:
                result.num_shared_blocks = shared - block
                result.shared_depth = source.num_layers
                result.shared_source = source.name
                break
        return result

    def _block_tier(self, lineages, block_hash: bytes) -> Tier | None:
        """The slowest tier any page of this block lives in, or None if one is missing."""
        slowest = Tier.ARENA
        lookup = self.pool.lookup
        for lineage in lineages:
            key = PageKey(lineage=lineage, block_hash=block_hash)
            if lookup(key) is not None:
                continue            # in the arena: the fastest tier (what _locate says first)
            tier = self.tiers.locate(key) if self.tiers is not None else None
            if tier is None:
                return None
            if tier is Tier.DISK or (tier is Tier.HOST and slowest is Tier.ARENA):
                slowest = tier
        return slowest

    def estimate_cached_tokens(self, member: str, hashes: list[bytes]) -> int:
        """Router's cheap estimate: binary search for the longest cached prefix, checking only the top
        layer's key. Prefixes are cached head-first (a block's key chains all earlier blocks, and a
        request releases its deepest blocks first), and all pages of a block leave the arena together."""
        top = self.family.member(member).layer_lineages[-1]
        low, high = 0, len(hashes)          # invariant: blocks < low are cached, blocks >= high are not
        while low < high:
            mid = (low + high) // 2
            if self._locate(PageKey(top, hashes[mid])) is None:
                high = mid
            else:
                low = mid + 1
        return low * self._blocks[member]

    # ------------------------------------------------------------------ allocation
    def attach(self, member: str, match: PrefixMatch, hashes: list[bytes], total_tokens: int,
               reserve_pages: int = 0, evict: bool = True, account: str | None = None,
               residuals: bool = True) -> tuple[SeqKV, list[tuple[PageId, PageKey, Tier]]] | None:
        """Builds a request's block tables for its first total_tokens: acquires matched arena pages,
        allocates pages for tier hits (returned as loads) and for the rest. None if pages are short
        (then nothing is held). reserve_pages must stay available afterwards (decode headroom);
        evict=False admits only into never-used free pages (warm-ups use idle memory only).
        account: the pool member the pages are allocated as (None: member); residuals=False: no residual pages
        even where the member records them (a draft's KV: no handover starts from it)."""
        records = residuals and self.layout.records_residual(member)
        account = account or member
        slots = self._table_slots(member, match, hashes, records)
        # arena hits are pinned first, so allocating the fresh pages (None) cannot evict them
        pages = self.pool.acquire_keys([slot[3] for slot in slots], account)
        num_blocks = -(-total_tokens // self._blocks[member])
        num_grow = max(0, num_blocks - match.num_full_blocks - match.num_shared_blocks)
        per_block = self.pages_per_block(member) if records else self.family.member(member).num_layers
        fresh = pages.count(None) + num_grow * per_block
        enough = (self.pool.can_allocate(account, fresh + reserve_pages) if evict
                  else self.pool.counts()["free"] >= fresh + reserve_pages)
        if not enough:
            for page in pages:
                if page is not None:
                    self.pool.release(page)
            return None
        seq, loads = self._fill_tables(member, slots, pages, account, records)
        seq.num_registered_blocks = match.num_full_blocks
        if not self.grow(seq, total_tokens):
            raise RuntimeError("page pool short after can_allocate said yes")  # invariant
        return seq, loads

    def arena_hits(self, member: str, match: PrefixMatch, hashes: list[bytes]) -> list[PageId]:
        """The arena pages attach() would share for this match (read only: nothing is acquired)."""
        return [page for *_, key in self._table_slots(member, match, hashes, self.layout.records_residual(member))
                if key is not None and (page := self.pool.lookup(key)) is not None]

    def _table_slots(self, member: str, match: PrefixMatch, hashes: list[bytes], records: bool) -> list[_Slot]:
        """The matched part of a request's tables, in table order: full blocks (every layer under its key, and
        the residual this member records if some tier holds it), then shared blocks (lower layers under their
        keys, upper layers fresh, the source's residual read in, this member's own residual fresh)."""
        spec = self.family.member(member)
        slots: list[_Slot] = []
        for block in range(match.num_full_blocks):
            block_hash = hashes[block]
            slots.extend([("kv", layer, block, PageKey(lineage=lineage, block_hash=block_hash))
                          for layer, lineage in enumerate(spec.layer_lineages)])
            if records:
                key = PageKey(spec.residual_lineage(), hashes[block])
                slots.append(("out", None, block, key if self._locate(key) is not None else None))
        if match.num_shared_blocks:
            assert match.shared_source is not None
            source = self.family.member(match.shared_source)
            for block in range(match.num_full_blocks, match.num_full_blocks + match.num_shared_blocks):
                for layer in range(spec.num_layers):
                    lower = PageKey(spec.layer_lineages[layer], hashes[block]) if layer < match.shared_depth else None
                    slots.append(("kv", layer, block, lower))
                slots.append(("in", None, block, PageKey(source.residual_lineage(), hashes[block])))
                if records:
                    slots.append(("out", None, block, None))
        return slots

    def _fill_tables(self, member: str, slots: list[_Slot], pages: list[PageId | None], account: str,
                     records: bool) -> tuple[SeqKV, list[tuple[PageId, PageKey, Tier]]]:
        """Allocates the missing pages and lays every slot into the request's tables; a slot whose key a
        tier holds gets its key now and a load to run before the step."""
        spec = self.family.member(member)
        loads: list[tuple[PageId, PageKey, Tier]] = []
        seq = SeqKV(member=member, tokens_per_block=self._blocks[member],
                    block_tables=[[] for _ in range(spec.num_layers)],
                    residual_out=[] if records else None, account=None if account == member else account)
        for (kind, layer, block, key), page in zip(slots, pages):
            if page is None:
                page = self._new(account)
                if key is not None:
                    tier = self.tiers.locate(key) if self.tiers is not None else None
                    if tier is None:
                        raise RuntimeError(f"tier entry for {key} vanished between match and attach")
                    self.pool.register(page, key)
                    loads.append((page, key, tier))
            if kind == "kv":
                assert layer is not None
                seq.block_tables[layer].append(page)
            elif kind == "out":
                assert seq.residual_out is not None
                seq.residual_out.append(page)
            else:
                seq.residual_in[block] = page
        return seq, loads

    def _new(self, member: str) -> PageId:
        pages = self.pool.allocate(member, 1)
        if pages is None:
            raise RuntimeError("page pool short after can_allocate said yes")  # invariant
        return pages[0]

    def grow(self, seq: SeqKV, total_tokens: int) -> bool:
        """Adds blocks so the tables cover total_tokens. All or nothing."""
        missing = -(-total_tokens // seq.tokens_per_block) - seq.num_blocks
        if missing <= 0:
            return True
        per_block = len(seq.block_tables) + (seq.residual_out is not None)
        pages = self.pool.allocate(seq.account or seq.member, missing * per_block)
        if pages is None:
            return False
        it = iter(pages)
        for _ in range(missing):
            for table in seq.block_tables:
                table.append(next(it))
            if seq.residual_out is not None:
                seq.residual_out.append(next(it))
        return True

    def register_full_blocks(self, seq: SeqKV, hashes: list[bytes], num_computed_tokens: int) -> None:
        """Gives every newly full, fully computed block its keys so later requests can hit it."""
        full = min(len(hashes), num_computed_tokens // seq.tokens_per_block)
        if full <= seq.num_registered_blocks:
            return              # nothing newly full (every decode step but one per block)
        spec = self.family.member(seq.member)
        for block in range(seq.num_registered_blocks, full):
            block_hash = hashes[block]
            self.pool.register_pages([table[block] for table in seq.block_tables],
                                     [PageKey(lineage=lineage, block_hash=block_hash)
                                      for lineage in spec.layer_lineages])
            if seq.residual_out is not None:
                self.pool.register(seq.residual_out[block], PageKey(spec.residual_lineage(), hashes[block]))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def num_private_pages(self, seq: SeqKV) -> int:
        """How many of the request's pages only it references (what it gives back when it ends): the pool's
        count over all its pages, memoized. While the pool's sharing epoch stands still no page changed
        between private and shared, and the request's tables only grew by pages it allocated itself (grow:
        refcount 1), so the count moves by exactly the pages added. The peak reservation asks this for every
        running request on every arrival (~10^3 pages each at paper scale: the simulator's top cost)."""
        epoch, count = self.pool.sharing_epoch, seq.num_pages()
        memo = seq._private
        if memo is not None and memo[0] == epoch and memo[1] <= count:
            private = memo[2] + count - memo[1]
        else:
            private = self.pool.num_private(seq.all_pages())
        seq._private = (epoch, count, private)
        return private

    def release(self, seq: SeqKV) -> None:
        """Drops the request's references; keyed pages stay cached (delayed reclamation, LRU)."""
        # Release deepest blocks first so a prefix's head stays in the arena longest (LRU order).
        order: list[PageId] = []
        residual_out = seq.residual_out
        for block in reversed(range(seq.num_blocks)):
            order.extend([table[block] for table in seq.block_tables])
            if residual_out is not None and block < len(residual_out):
                order.append(residual_out[block])
        order.extend(seq.residual_in.values())
        self.pool.release_pages(order)
        seq.block_tables = [[] for _ in seq.block_tables]
        seq.residual_out = [] if seq.residual_out is not None else None
        seq.residual_in = {}
        seq._view = None
        seq._private = None
