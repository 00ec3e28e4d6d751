"""Continuous batching: which requests run in the next engine step, and how many tokens each.

Each step has a token budget (``max_num_batched_tokens``). Running requests come first, in
admission order: a decode costs one token, a prompt still being prefilled costs the rest of its
prompt or whatever budget is left (chunked prefill). Waiting requests are admitted after them,
oldest first, each starting after its cached prefix.

With ``reservation_share`` set, the cached prefixes of the first waiting requests are reserved
from the step after their arrival (``Reservations.reserve``: held, host-only blocks
prefetched), and the newest reservation gives way whenever blocks are short, before any
preemption.

With a disk tier, a waiting request whose prefix continues on disk first has those blocks read
into host blocks (``DiskOnboarding.onboard``); it keeps its place in the queue meanwhile and the
requests behind it are admitted past it (at most ``RESERVE_LOOKAHEAD`` of them wait so). A
waiting request whose next prompt block a running request's prefill is computing (the prompts
share it) waits the same way, for that block to be cached, instead of computing it again.

With ``speculative_ngram`` K > 0, a running request in decode whose sampling parameters allow
it (``SamplingParams.can_speculate``) is scheduled with up to K draft tokens after its last
token (``replicas.engine.ngram_proposer``), bounded by the step's budget (one token is kept for each
running request after it), ``max_tokens`` and ``max_model_len``; its blocks cover the drafts
too. A request short of blocks for its drafts decodes without them rather than preempt anyone.
The update (``replicas.engine.core``) keeps what the model confirmed and tells the proposer
(``record_drafts``), which drops more of a request's drafts while they keep failing.

When the NPU tier cannot give a running request its next block, the most recently admitted
running request is preempted: its blocks are released (its cached prefix usually survives) and
it goes back to the front of the queue, to be recomputed later with its outputs kept.

The scheduler never touches tensors or blocks; the KV cache manager owns both decisions about
blocks and the plan of copies between tiers.
"""

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from replicas.config import SchedulerConfig
from replicas.engine.ngram_proposer import NgramProposer
from replicas.engine.request import Request, RequestStatus
from replicas.kv.manager import KVCacheManager
from replicas.kv.records import PrefixMatch, TransferPlan

RESERVE_LOOKAHEAD = 16
"""Waiting requests, from the front of the queue, whose prefixes a step tries to reserve."""


class ScheduledRequest(NamedTuple):
    request: Request
    num_new_tokens: int  # computed this step, after request.num_computed_tokens (drafts too)
    block_ids: list[int]  # the request's NPU blocks of the primary cache type, in token order
    block_tables: dict[str, list[int | None]]  # per cache type (None: released sliding block)
    draft_token_ids: tuple[int, ...] = ()  # guessed tokens after the last one, to verify

    @property
    def is_sampled(self) -> bool:
        """Whether this step completes the request's context, so that it gets a token (read
        before the step's update)."""
        request = self.request
        return request.num_computed_tokens + self.num_new_tokens >= request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: each scheduled request with its new tokens and blocks, in batch order."""

    scheduled: list[ScheduledRequest]
    transfer: TransferPlan


class Scheduler:
    """``prefix_limit(request)``, when given, bounds the cached blocks a request may start
    after (``replicas.engine.prompt_logprobs``: a prompt being scored needs its prefix's scores).
    ``max_model_len`` bounds draft tokens (none without it)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        prefix_limit: Callable[[Request], int | None] | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.prefix_limit = prefix_limit
        self.max_model_len = max_model_len
        self.proposer = (
            NgramProposer(config.speculative_ngram)
            if config.speculative_ngram and max_model_len is not None
            else None
        )
        self._gave_way: set[str] = set()  # waiting requests whose reservation was dropped
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, scheduled, preempted)
        if not preempted:  # admitting new requests in a step that had to preempt would thrash
            self._schedule_waiting(budget, scheduled)
            self._reserve_waiting()  # and so would reserving in a step short of blocks
            self._onboard_waiting()
        return SchedulerOutput(scheduled, self.kv_cache.take_transfer_plan())

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        """Schedule the running requests in order (with their draft tokens where they fit),
        preempting when blocks run out (``_victim``: batch requests first, newest first);
        returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget - (len(self.running) - index))
            if drafts and not self.kv_cache.allocate_slots(request, num_new + len(drafts)):
                drafts = []  # drafts are not worth a preemption
            num_new += len(drafts)
            while not self.kv_cache.allocate_slots(request, num_new):
                if self._give_way():  # reservations give way first
                    continue
                victim = self._victim(index)
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new, drafts))
                budget -= num_new
                index += 1
                continue
            # The request preempted itself: after it come only interactive requests (where it
            # was a batch one), which go on with the blocks it freed.
        return budget

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        """Admit waiting requests in order while the budget, ``max_num_seqs`` and the blocks
        allow; one whose disk reads are under way is passed over (up to RESERVE_LOOKAHEAD), and
        so, once a batch request is short of blocks, is every batch request: interactive ones
        go on past them."""
        position = 0  # waiting requests ahead of it wait for disk reads or, batch, for blocks
        batch_waits = False  # a batch request was short of blocks: later ones wait behind it
        while len(self.waiting) > position and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[position]
            if batch_waits and request.batch:
                position += 1
                continue
            limit = self.prefix_limit(request) if self.prefix_limit is not None else None
            if self.kv_cache.onboarding.onboard(request, limit):
                position += 1
                if position >= RESERVE_LOOKAHEAD:
                    break
                continue
            match = self.kv_cache.match_prefix(request, limit)
            if self._computing(request, match.num_blocks, limit):
                position += 1  # its next block is being computed: it waits for it
                if position >= RESERVE_LOOKAHEAD:
                    break
                continue
            num_computed = match.num_tokens(self.kv_cache.block_size)
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            while not self.kv_cache.allocate_slots(request, num_new, match):
                if not self._give_way(keep=request.request_id):
                    break  # later arrivals' reservations give way to the oldest waiting request
                match = self.kv_cache.match_prefix(request, limit)
                num_computed = match.num_tokens(self.kv_cache.block_size)
                num_new = min(request.num_tokens - num_computed, budget)
            else:
                self._admit(request, match, num_computed, num_new, scheduled, position)
                budget -= num_new
                continue
            if not request.batch:
                break
            batch_waits = True  # the interactive requests behind it go on
            position += 1

    def _computing(self, request: Request, num_matched: int, limit: int | None) -> bool:
        """Whether the next block of a waiting request's prompt, past its ``num_matched``
        cached ones, is one a running request's prefill computes in this step or a later one:
        the two prompts share it (its hash), so the waiting request waits to find it cached
        instead of computing it too (two requests of one new prefix arriving together, or
        one arriving while another computes or pulls it)."""
        block_size = self.kv_cache.block_size
        index = num_matched
        last = (request.num_tokens - 1) // block_size  # a request computes one token at least
        if not self.kv_cache.enable_prefix_caching or index >= last:
            return False
        if limit is not None and index >= limit:
            return False
        block_hash = request.block_hashes[index]
        return any(
            other.num_computed_tokens // block_size <= index < other.num_prompt_tokens // block_size
            and other.block_hashes[index] == block_hash
            for other in self.running
        )

    def _admit(
        self,
        request: Request,
        match: PrefixMatch,
        num_computed: int,
        num_new: int,
        scheduled: list[ScheduledRequest],
        position: int = 0,
    ) -> None:
        self.kv_cache.record_admission(request, match)
        self._gave_way.discard(request.request_id)
        if position:
            del self.waiting[position]
        else:
            self.waiting.popleft()
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        scheduled.append(self._scheduled(request, num_new))

    def _reserve_waiting(self) -> None:
        """Reserve the cached prefixes of the first ``RESERVE_LOOKAHEAD`` waiting requests
        not reserved yet, oldest first (see ``Reservations.reserve``). Asked again every
        step, since a prefix a request ahead computes becomes cached after its arrival; but
        not for a request whose reservation gave way (it would only be dropped again)."""
        if not self.kv_cache.reservations.share:
            return
        for request in itertools.islice(self.waiting, RESERVE_LOOKAHEAD):
            request_id = request.request_id
            if request_id not in self._gave_way and not self.kv_cache.reservations.has(request_id):
                self.kv_cache.reservations.reserve(request)

    def _onboard_waiting(self) -> None:
        """Start the disk reads of the first ``RESERVE_LOOKAHEAD`` waiting requests, so that
        they overlap the steps before those requests' turn."""
        if not self.kv_cache.onboarding.is_on:
            return
        for request in itertools.islice(self.waiting, RESERVE_LOOKAHEAD):
            limit = self.prefix_limit(request) if self.prefix_limit is not None else None
            self.kv_cache.onboarding.onboard(request, limit)

    def _give_way(self, keep: str | None = None) -> bool:
        dropped = self.kv_cache.reservations.drop_newest(keep)
        if dropped is None:
            return False
        self._gave_way.add(dropped)
        return True

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a running request in decode, at most ``budget`` of them, none
        past ``max_tokens`` or ``max_model_len`` (the token after the drafts counts too)."""
        if (
            self.proposer is None
            or request.num_tokens - request.num_computed_tokens != 1
            or not request.sampling_params.can_speculate
        ):
            return []
        room = min(
            budget,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request.request_id, request.all_token_ids, room)

    def record_drafts(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:
        """How a request's verified draft fared (``NgramProposer.record``)."""
        if self.proposer is not None:
            self.proposer.record(request_id, num_draft_tokens, num_accepted)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stopped, length or aborted) and release its blocks."""
        self._gave_way.discard(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request)

    def _scheduled(
        self, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        request_id = request.request_id
        return ScheduledRequest(
            request,
            num_new,
            self.kv_cache.block_ids(request_id),
            self.kv_cache.block_tables(request_id),
            tuple(drafts or ()),
        )

    def _victim(self, index: int) -> Request:
        """Take out of ``running`` the request to preempt so that ``running[index]`` gets
        blocks: the newest batch request not scheduled yet this step; else that request itself
        when it is a batch one (a batch request never preempts an interactive one); else the
        newest."""
        for i in range(len(self.running) - 1, index, -1):
            if self.running[i].batch:
                return self.running.pop(i)
        return self.running.pop(index if self.running[index].batch else -1)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(request)
