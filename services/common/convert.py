"""Conversions between the wire messages (services/protos) and the engine's Python objects.

Every ``*_from_proto`` that reads user input raises ``InvalidRequest`` whose ``field`` is the
message path (``destination.index_mode``), so the service answers INVALID_ARGUMENT naming it.
"""

from __future__ import annotations

from engine.model.sampler import InvalidRequest, SamplingParams, TokenLogprob
from engine.cache.content_key import BLOCK_TOKENS, KvEventLog
from engine.handoff import KvDestination, RankEndpoint
from services.protos import common_pb2, decode_pb2, kv_pb2

_INDEX_MODES = {"copied": kv_pb2.INDEX_MODE_COPIED, "split": kv_pb2.INDEX_MODE_SPLIT}
_FINISH_REASONS = {"stop": decode_pb2.FINISH_REASON_STOP, "length": decode_pb2.FINISH_REASON_LENGTH,
                   "abort": decode_pb2.FINISH_REASON_ABORT, "preempted": decode_pb2.FINISH_REASON_PREEMPTED}


# ---- sampling ----------------------------------------------------------------------------
def sampling_from_proto(msg: common_pb2.Sampling, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """The stop rule (documented in common.proto):

    - ``stop_token_ids`` given: those ids, plus the model's EOS ids unless ``ignore_eos``;
    - none given and ``ignore_eos``: ``()`` (never stop early);
    - none given otherwise: ``None`` (the scheduler uses the model's EOS ids).

    ``top_p`` and ``repetition_penalty`` 0 on the wire mean unset (1.0). Range checks are SamplingParams.validate's.
    """
    given = tuple(msg.stop_token_ids)
    if given:
        stop = given if msg.ignore_eos else given + tuple(t for t in eos_token_ids if t not in given)
    else:
        stop = () if msg.ignore_eos else None
    return SamplingParams(max_new_tokens=msg.max_new_tokens, temperature=msg.temperature,
                          top_p=msg.top_p or 1.0, top_k=msg.top_k,
                          seed=msg.seed if msg.HasField("seed") else None, stop_token_ids=stop,
                          min_tokens=msg.min_tokens, presence_penalty=msg.presence_penalty,
                          frequency_penalty=msg.frequency_penalty, repetition_penalty=msg.repetition_penalty or 1.0,
                          logit_bias=tuple(sorted(msg.logit_bias.items())),
                          logprobs=msg.logprobs if msg.HasField("logprobs") else None,
                          prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None)


def logprob_to_proto(lp: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


# ---- the KV destination -------------------------------------------------------------------
def fingerprint_to_proto(fp: dict) -> kv_pb2.LayoutFingerprint:
    return kv_pb2.LayoutFingerprint(model=fp["model"], dtype=fp["dtype"], latent_dim=fp["latent_dim"],
                                    index_head_dim=fp["index_head_dim"], num_layers=fp["num_layers"],
                                    indexer_layers=list(fp["indexer_layers"]), kv_cache_dtype=fp["kv_cache_dtype"],
                                    kv_entry_bytes=fp["kv_entry_bytes"], kv_index_bytes=fp["kv_index_bytes"],
                                    kv_scales=list(fp["kv_scales"]))


def fingerprint_from_proto(msg: kv_pb2.LayoutFingerprint) -> dict:
    return {"model": msg.model, "dtype": msg.dtype, "kv_cache_dtype": msg.kv_cache_dtype,
            "kv_entry_bytes": msg.kv_entry_bytes, "kv_index_bytes": msg.kv_index_bytes,
            "kv_scales": list(msg.kv_scales), "latent_dim": msg.latent_dim,
            "index_head_dim": msg.index_head_dim, "num_layers": msg.num_layers,
            "indexer_layers": list(msg.indexer_layers)}


def rank_to_proto(ep: RankEndpoint) -> kv_pb2.RankEndpoint:
    return kv_pb2.RankEndpoint(session=ep.session, latent_ptr=ep.latent_ptr, rows=ep.rows,
                               latent_row_bytes=ep.latent_row_bytes, index_ptrs=dict(ep.index_ptrs),
                               index_rows=ep.index_rows, index_row_bytes=ep.index_row_bytes)


def rank_from_proto(msg: kv_pb2.RankEndpoint) -> RankEndpoint:
    return RankEndpoint(session=msg.session, latent_ptr=msg.latent_ptr, rows=msg.rows,
                        latent_row_bytes=msg.latent_row_bytes, index_ptrs=dict(msg.index_ptrs),
                        index_rows=msg.index_rows, index_row_bytes=msg.index_row_bytes)


def destination_to_proto(dest: KvDestination, decode_address: str) -> kv_pb2.KvDestination:
    return kv_pb2.KvDestination(
        reservation_id=dest.reservation_id, dcp=dest.dcp, page_size=dest.page_size,
        index_mode=_INDEX_MODES[dest.index_mode], slots=list(dest.slots), prefix_tokens=dest.prefix,
        ranks=[rank_to_proto(r) for r in dest.ranks], fingerprint=fingerprint_to_proto(dest.fingerprint),
        expires_at_unix_s=dest.expires_at, decode_address=decode_address)


def destination_from_proto(msg: kv_pb2.KvDestination) -> KvDestination:
    """A destination as the prefill engine takes it; structural problems name the field."""
    def bad(field: str, why: str) -> InvalidRequest:
        return InvalidRequest(f"destination.{field}", why)

    if not msg.reservation_id:
        raise bad("reservation_id", "must not be empty")
    if msg.dcp < 1:
        raise bad("dcp", f"must be >= 1, got {msg.dcp}")
    if len(msg.ranks) != msg.dcp:
        raise bad("ranks", f"{len(msg.ranks)} rank endpoints for dcp {msg.dcp}")
    if msg.page_size < 1:
        raise bad("page_size", f"must be >= 1, got {msg.page_size}")
    modes = {v: k for k, v in _INDEX_MODES.items()}
    if msg.index_mode not in modes:
        raise bad("index_mode", f"must be INDEX_MODE_COPIED or INDEX_MODE_SPLIT, got {msg.index_mode}")
    if not msg.HasField("fingerprint"):
        raise bad("fingerprint", "is missing")
    if not msg.decode_address:
        raise bad("decode_address", "must not be empty")
    return KvDestination(reservation_id=msg.reservation_id, dcp=msg.dcp, page_size=msg.page_size,
                         index_mode=modes[msg.index_mode], slots=tuple(msg.slots), prefix=msg.prefix_tokens,
                         ranks=tuple(rank_from_proto(r) for r in msg.ranks),
                         fingerprint=fingerprint_from_proto(msg.fingerprint), expires_at=msg.expires_at_unix_s)


def finish_reason_to_proto(reason: str) -> int:
    return _FINISH_REASONS[reason]


MAX_CACHE_SALT = 256  # characters (the router allows as many)


def check_cache_salt(salt: str) -> str:
    if len(salt) > MAX_CACHE_SALT:
        raise InvalidRequest("cache_salt", f"at most {MAX_CACHE_SALT} characters, got {len(salt)}")
    return salt


_EVENT_KINDS = {"stored": common_pb2.KvEvent.KIND_STORED, "removed": common_pb2.KvEvent.KIND_REMOVED}


def kv_events_to_proto(log: KvEventLog | None, request: common_pb2.KvEventsRequest) -> common_pb2.KvEvents:
    """The events of ``log`` after the caller's (a snapshot when they do not continue it); a
    service without a prefix cache answers an empty snapshot."""
    if log is None:
        return common_pb2.KvEvents(reset=True, block_tokens=BLOCK_TOKENS)
    batch = log.since(request.incarnation, request.after)
    return common_pb2.KvEvents(
        incarnation=batch.incarnation, last=batch.last, reset=batch.reset, snapshot=list(batch.snapshot),
        events=[common_pb2.KvEvent(kind=_EVENT_KINDS[kind], block_keys=list(keys)) for kind, keys in batch.events],
        key_seed=log.seed, block_tokens=BLOCK_TOKENS)
