"""Pure decisions of the connector: what to look up, load and save, in which token ranges.

Vocabulary (all counts in tokens):
- ``B`` = TensorRT-LLM ``tokens_per_block``; block ``i`` of a request holds tokens ``[i*B, (i+1)*B)``.
- ``C`` = LMCache ``chunk_size`` (a multiple of ``B``); LMCache stores and finds whole chunks only,
  and every key range it accepts starts and ends on a chunk boundary.
- ``computed`` = tokens TensorRT-LLM already has on the device (prefix reuse); block-aligned unless
  ``enable_partial_reuse`` (TensorRT-LLM's default) matched part of a block.
- ``hit`` = chunk-aligned prefix LMCache holds (its lookup result).

No I/O here: the scheduler's hooks (``scheduler.py``) gather inputs, call these and perform the effects.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvoffload.connector.keys import chunk_ceil, chunk_floor


@dataclass(frozen=True)
class LoadDecision:
    """What ``get_num_new_matched_tokens`` promises and how the worker will fetch it."""

    matched_tokens: int
    """Returned to TensorRT-LLM: tokens beyond ``computed`` the connector will load."""
    retrieve_start: int
    """Chunk-aligned first token of the retrieve key (the chunk holding ``computed``)."""
    retrieve_end: int
    """Chunk-aligned end of the retrieve key; ``<= hit``."""
    skip_tokens: int
    """Tokens at the start of the retrieve range that are already on the device (never written)."""
    free_ranges: tuple[tuple[int, int], ...]
    """Chunk-aligned ranges LMCache read-locked at lookup that will not be retrieved."""
    copy_end: int | None = None
    """Set when TensorRT-LLM honoured fewer tokens than promised (:func:`honour`): the copies stop
    here, while the retrieve key, under which the chunks were secured, stays whole."""

    @property
    def loads(self) -> bool:
        return self.matched_tokens > 0


NO_LOAD = LoadDecision(0, 0, 0, 0, ())


def lookup_end(num_prompt_tokens: int, num_computed_tokens: int, chunk_size: int) -> int:
    """End of the lookup key (chunk-aligned prompt prefix), or 0 when a lookup cannot help."""
    end = chunk_floor(num_prompt_tokens, chunk_size)
    return end if end > num_computed_tokens else 0


def promise_cap(num_prompt_tokens: int, tokens_per_block: int) -> int:
    """The most prompt tokens a load may promise: up to the last block boundary before the final
    token (the engine computes that block itself, for its logits)."""
    return ((num_prompt_tokens - 1) // tokens_per_block) * tokens_per_block if num_prompt_tokens > 0 else 0


def retrieve_bounds(
    num_prompt_tokens: int, num_computed_tokens: int, tokens_per_block: int, chunk_size: int
) -> tuple[int, int]:
    """``(start, cap)``: a load of any hit ``h`` (chunk-aligned) retrieves ``[start, min(h, cap))``:
    from the chunk holding the first token it writes (the device's prefix may end inside a block,
    which the load then rewrites from its first token) to the chunk end past the promise's cap."""
    first_written = (num_computed_tokens // tokens_per_block) * tokens_per_block
    return chunk_floor(first_written, chunk_size), chunk_ceil(
        promise_cap(num_prompt_tokens, tokens_per_block), chunk_size
    )


def decide_load(
    num_prompt_tokens: int,
    num_computed_tokens: int,
    hit_tokens: int,
    tokens_per_block: int,
    chunk_size: int,
) -> LoadDecision:
    """Decide how many tokens to promise TensorRT-LLM, given LMCache's hit.

    At least one prompt token is always left to compute (the engine needs its
    logits), so the promise stops at the last block boundary before the final
    token. The retrieve key covers whole chunks from the chunk containing
    ``computed`` to the chunk containing the promise's end; tokens of that range
    beyond the promise are rewritten with the identical KV the engine would
    compute, and tokens before ``computed`` are skipped (shared device blocks
    are never written).
    """
    hit = chunk_floor(min(hit_tokens, num_prompt_tokens), chunk_size)
    everything = ((0, hit),) if hit > 0 else ()
    if num_prompt_tokens <= 0:
        return LoadDecision(0, 0, 0, 0, everything)
    load_end = min(hit, promise_cap(num_prompt_tokens, tokens_per_block))
    if load_end <= num_computed_tokens:
        return LoadDecision(0, 0, 0, 0, everything)
    # With partial reuse the device's prefix may end inside a block: that block is the request's
    # own (TensorRT-LLM copies a partially matched block, or takes it when nobody else uses it),
    # so the load starts at its first token and rewrites its matched tokens with the same KV.
    first_written = (num_computed_tokens // tokens_per_block) * tokens_per_block
    retrieve_start, _ = retrieve_bounds(num_prompt_tokens, num_computed_tokens, tokens_per_block, chunk_size)
    retrieve_end = chunk_ceil(load_end, chunk_size)
    free = tuple((a, b) for a, b in ((0, retrieve_start), (retrieve_end, hit)) if b > a)
    return LoadDecision(
        matched_tokens=load_end - num_computed_tokens,
        retrieve_start=retrieve_start,
        retrieve_end=retrieve_end,
        skip_tokens=first_written - retrieve_start,
        free_ranges=free,
    )


def load_is_async(
    matched_tokens: int,
    async_min_tokens: int,
    world_size: int,
    attention_dp: bool = False,
    finished_by_every_rank: bool = False,
) -> bool:
    """Whether a load runs asynchronously: TensorRT-LLM parks the request and the batch goes on.

    Only from ``async_min_tokens`` on (a parked request waits at least one iteration, which a short
    load does not repay); under tensor parallelism only where TensorRT-LLM finishes each load once
    every rank reported it (``finished_by_every_rank``: prefix reservations, whose chunks go back to
    the server only then) — otherwise only a synchronous load, waited for by the forward's
    collectives, guarantees every rank copied before the chunks go back; and never under attention
    DP (TensorRT-LLM main marks the engine failed on every rank when a parked load outlives its fixed
    deadline, ``_KV_CONNECTOR_LOAD_TIMEOUT_SEC``; a synchronous load has no such deadline)."""
    ranks_ok = world_size == 1 or finished_by_every_rank
    return async_min_tokens > 0 and ranks_ok and not attention_dp and matched_tokens >= async_min_tokens


def honour(decision: LoadDecision, honoured_tokens: int, num_computed_tokens: int) -> LoadDecision:
    """The promise as TensorRT-LLM took it. KVCacheManagerV2 may honour fewer tokens than offered
    (``commit_new_matched_tokens``: a grow that failed falls back to the whole blocks its pages
    hold), and has pages only up to there: the copies stop at ``num_computed_tokens + honoured``."""
    if honoured_tokens >= decision.matched_tokens:
        return decision
    honoured = max(0, honoured_tokens)
    return replace(decision, matched_tokens=honoured, copy_end=num_computed_tokens + honoured)


def accept(
    decision: LoadDecision, num_computed_tokens: int, start: int, end: int, tokens_per_block: int
) -> LoadDecision:
    """The promise as a prefix reservation's accepted load ``[start, end)`` took it (TensorRT-LLM main's
    KVCacheManagerV2 trims a reservation at either end): copies from ``start`` (what is before it is on
    the device) to ``end``; the retrieve key, under which the chunks were secured, stays whole.
    Raises ValueError for a range outside the promise."""
    promised_end = num_computed_tokens + decision.matched_tokens
    if not decision.loads or start < num_computed_tokens or end > promised_end or end <= start:
        raise ValueError(
            f"accepted load [{start}, {end}) is not inside the promise [{num_computed_tokens}, {promised_end})"
        )
    trimmed = honour(decision, end - num_computed_tokens, num_computed_tokens)
    if start == num_computed_tokens:
        return trimmed
    first_written = (start // tokens_per_block) * tokens_per_block
    return replace(trimmed, matched_tokens=end - start, skip_tokens=first_written - decision.retrieve_start)


def decline(decision: LoadDecision) -> LoadDecision:
    """The same hit, promised to nobody (its load could not be secured). The retrieve range's
    lookup locks were taken over by PREPARE_RETRIEVE and go back with its COMMIT; the rest are freed."""
    return LoadDecision(0, 0, 0, 0, decision.free_ranges)


def compute_instead(decision: LoadDecision) -> LoadDecision:
    """The same hit, computed rather than loaded (nothing was secured): every chunk the lookup
    read-locked is freed."""
    ranges = sorted((*decision.free_ranges, (decision.retrieve_start, decision.retrieve_end)))
    merged: list[tuple[int, int]] = []
    for a, b in ranges:
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return LoadDecision(0, 0, 0, 0, tuple(merged))


def tokens_with_kv_after_step(tokens_with_kv_before: int, num_scheduled_tokens: int, num_known_tokens: int) -> int:
    """Tokens whose KV is valid after this forward pass (draft tokens never count)."""
    return min(tokens_with_kv_before + num_scheduled_tokens, num_known_tokens)


def plan_save(
    stored_upto: int,
    tokens_with_kv: int,
    num_block_tokens: int,
    num_prompt_tokens: int,
    chunk_size: int,
    save_decode_tokens: bool,
) -> tuple[int, int] | None:
    """The chunk-aligned range ``[start, end)`` to store now, or None.

    Only whole chunks whose KV is valid and whose blocks the request owns are
    stored; decode tokens only when ``save_decode_tokens``.
    """
    limit = min(tokens_with_kv, num_block_tokens)
    if not save_decode_tokens:
        limit = min(limit, num_prompt_tokens)
    end = chunk_floor(limit, chunk_size)
    start = chunk_floor(stored_upto, chunk_size)
    if end <= start:
        return None
    return start, end


def first_live_block(history_tokens: int, window_size: int | None, tokens_per_block: int) -> int:
    """The first block ordinal a layer group still holds a page for once ``history_tokens`` have KV:
    a sliding window of ``W`` tokens released the blocks before ``(history + 1 - W) // B``
    (KVCacheManagerV2's ``AttnLifeCycle.get_stale_range``, no sink tokens); full attention: 0."""
    if window_size is None:
        return 0
    return max(0, (history_tokens + 1 - window_size) // tokens_per_block)


def grouped_save_end(
    start: int,
    end: int,
    group_block_ids: list[list[int]] | tuple[tuple[int, ...], ...],
    first_live: list[int] | tuple[int, ...],
    tokens_per_block: int,
    chunk_size: int,
) -> int:
    """The end of the chunks of ``[start, end)`` (chunk-aligned) whose every block has a live page in
    every other layer group (``group_block_ids[g]``, from ordinal ``first_live[g]`` on; -1: no page):
    a chunk holds every group's pages, so one without a page in some group is never stored, nor is
    anything after it (lookups find prefixes). ``start`` when the first chunk cannot be stored."""
    saved = start
    per_chunk = chunk_size // tokens_per_block
    for chunk_start in range(start, end, chunk_size):
        first = chunk_start // tokens_per_block
        ordinals = range(first, first + per_chunk)
        for ids, live in zip(group_block_ids, first_live, strict=True):
            if first < live or any(o >= len(ids) or ids[o] < 0 for o in ordinals):
                return saved
        saved = chunk_start + chunk_size
    return saved


def pipeline_groups(start: int, end: int, chunk_size: int, groups: int) -> list[tuple[int, int]]:
    """``[start, end)`` (chunk-aligned) cut into at most ``groups`` runs of whole chunks, in order:
    one operation's PREPAREs go one group at a time, each while the previous group's copies run."""
    chunks = (end - start) // chunk_size
    if chunks <= 0:
        return []
    per_group = -(-chunks // max(1, groups))
    return [(a, min(a + per_group * chunk_size, end)) for a in range(start, end, per_group * chunk_size)]


def block_slice(block_ids: list[int] | tuple[int, ...], start: int, end: int, tokens_per_block: int) -> tuple[int, ...]:
    """Block ids holding tokens ``[start, end)`` (both block-aligned)."""
    return tuple(block_ids[start // tokens_per_block : end // tokens_per_block])


def written_blocks(block_ids: tuple[int, ...], skip_tokens: int, tokens_per_block: int) -> tuple[int, ...]:
    """The blocks a load writes: its op's blocks past the device-reused ones it skips (those are
    shared with other requests, read-only, and never the load's target)."""
    return block_ids[skip_tokens // tokens_per_block :]


def fresh_blocks(
    new_block_ids: list[int], computed_position: int, tokens_per_block: int, first_report: bool
) -> list[int]:
    """The blocks of one ``RequestData`` report that were free before this iteration.

    A request's first report lists its device-reused prefix blocks too (shared, read-only; they
    end at ``computed_position``); every other block it reports was taken from the free pool.
    """
    if not first_report:
        return list(new_block_ids)
    return list(new_block_ids[computed_position // tokens_per_block :])


def reused_blocks(new_block_ids: list[int], computed_position: int, tokens_per_block: int) -> list[int]:
    """The blocks of a request's first ``RequestData`` report that its forward reads but did not take
    from the free pool: those holding its device-reused prefix ``[0, computed_position)``."""
    return list(new_block_ids[: -(-computed_position // tokens_per_block)])


def unseen_forward_may_write(attention_dp: bool, num_reported: int) -> bool:
    """Whether this iteration's forward may write a free block the connector is not told of: under
    attention DP a rank with no request of its own joins the others' forward with a dummy request
    (``_pad_attention_dp_dummy_request``), on a page from the free pool in every layer group, and the
    connector never sees it. With no request on the rank, every request the connector still tracks
    has ended without ``request_finished``, so each of their pages may be one of those."""
    return attention_dp and num_reported == 0


def vanished_holders(
    fresh: list[int], reused: list[int], holders: dict[int, set[int]], loading_into: dict[int, int], owner: int
) -> set[int]:
    """Requests other than ``owner`` that ended (cancel, error, abort) without ``request_finished``:
    those still listing a block TensorRT-LLM just handed out again (``fresh``), and parked ones whose
    asynchronous load writes a block another request reuses (``reused``; ``loading_into``: block ->
    parked request). A live parked request's load targets are its own: only its cancellation, which
    stores them for reuse, lets another request match them."""
    out: set[int] = set()
    for block in fresh:
        out.update(rid for rid in holders.get(block, ()) if rid != owner)
    for block in reused:
        rid = loading_into.get(block)
        if rid is not None and rid != owner:
            out.add(rid)
    return out


def computed_reasons(
    num_prompt_tokens: int,
    first_computed: int,
    hit_tokens: int | None,
    tokens_per_block: int,
    chunk_size: int,
    failure: str | None = None,
    declined_as: str = "declined",
) -> tuple[tuple[int, int, str], ...]:
    """Why each prompt token from ``first_computed`` on is computed: ordered ``(start, end, reason)``
    ranges covering ``[first_computed, num_prompt_tokens)`` (reasons: ``contract.COMPUTED_REASONS``).

    ``hit_tokens`` is LMCache's hit (None: no lookup was made); ``failure`` the reason a lookup
    failed (``lookup_timeout`` or ``cache_unavailable``) or was not made (``uncacheable``);
    ``declined_as`` the reason of a loadable hit that was not loaded.
    """
    ranges: list[tuple[int, int, str]] = []
    at = first_computed

    def upto(end: int, reason: str) -> None:
        nonlocal at
        if end > at:
            ranges.append((at, end, reason))
            at = end

    whole_chunks = chunk_floor(num_prompt_tokens, chunk_size)
    if failure is not None:
        upto(whole_chunks, failure)
    elif hit_tokens is None:
        upto(whole_chunks, "no_lookup")
    else:
        hit = chunk_floor(min(hit_tokens, num_prompt_tokens), chunk_size)
        # loadable, yet not loaded (first_computed is past it otherwise)
        upto(min(hit, promise_cap(num_prompt_tokens, tokens_per_block)), declined_as)
        upto(hit, "final_block")
        upto(whole_chunks, "not_cached")
    upto(num_prompt_tokens, "partial_chunk")
    return tuple(ranges)


def split_computed(reasons: tuple[tuple[int, int, str], ...], start: int, end: int) -> list[tuple[str, int]]:
    """The tokens of ``[start, end)`` per reason (a step's computed prompt tokens)."""
    return [(reason, min(b, end) - max(a, start)) for a, b, reason in reasons if min(b, end) > max(a, start)]
