"""One completion as both fronts see it: token and text deltas, then how it finished.

``CompletionRunner.run`` wraps the dispatcher's token stream with the text rules of
textstream.py and records what the client experiences (metrics.py): TTFT and its stages, queue
time (:data:`QUEUE_STAGES`), every inter-token gap, time per output token, end-to-end latency,
prompt and generated tokens, prefix-cache lookups, requests waiting (before the first token) and
running (after it), the outcome and the finish reason. It stops the backend stream itself when a
stop string ends the text (closing the dispatcher's generator cancels the decode stream).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from services.router.backend import BackendError, Done, Job, Token
from services.router.dispatch import Dispatcher, Start
from services.router.metrics import RouterMetrics
from services.router.stages import TTFT_STAGES, TtftClock
from services.router.textstream import TextAssembler

# A request's queue time (vLLM's request_queue_time_seconds) on the disaggregated path: from its
# arrival until the prefill engine takes it — parsing, the decode reservation, the prefill queue.
QUEUE_STAGES = ("parse", "reserve", "prefill_queue")

# Outcome label of a request that failed with this code before or while streaming.
_OUTCOME = {grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded", grpc.StatusCode.UNAVAILABLE: "unavailable",
            grpc.StatusCode.INVALID_ARGUMENT: "invalid"}


@dataclass(frozen=True)
class CompletionRequest:
    job: Job
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: frozenset[int] = frozenset()  # every id that ends the stream (EOS included unless ignored)
    index: int = 0  # the choice's index in the response
    prompt_index: int = 0  # which of the request's prompts
    include_stop: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    prompt_text: str | None = None  # the prompt as the client sent it, when it was text (for echo)
    fork: int = 0  # which of ``job``'s forks (samples of one prompt) this choice is


@dataclass(frozen=True)
class TokenDelta:
    id: int
    index: int
    text: str  # new visible text (may be "")
    logprob: Any = None  # .logprob, .top_ids, .top_logprobs (common_pb2.TokenLogprob), when asked for
    prompt_logprobs: tuple = ()  # on token 0, with echo and logprobs: prompt tokens 1.. scored


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length"
    text: str  # held-back text flushed at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt tokens, those the prefill prefix cache already held


class CompletionRunner:
    def __init__(self, dispatcher: Dispatcher, tokenizer, metrics: RouterMetrics):
        self.dispatcher, self.tokenizer, self.metrics = dispatcher, tokenizer, metrics

    def run_all(self, reqs: tuple[CompletionRequest, ...], arrived: float | None = None
                ) -> list[AsyncIterator[TokenDelta | Finished]]:
        """One stream per choice; the choices of one job (its forks) share one start (one
        reservation and one prefill)."""
        starts: dict[int, Start] = {}
        return [self.run(r, arrived, starts.setdefault(id(r.job), Start(self.dispatcher, r.job))) for r in reqs]

    async def run(self, req: CompletionRequest, arrived: float | None = None,
                  start: Start | None = None) -> AsyncIterator[TokenDelta | Finished]:
        """``arrived``: when the request reached the router (perf_counter; default now), where
        TTFT and its breakdown start. ``start``: the start ``req.job``'s forks share."""
        clock = TtftClock(arrived)
        clock.lap("parse")
        token_times: list[float] = []
        text = TextAssembler(self.tokenizer, req.stop, req.stop_token_ids, req.include_stop, req.skip_special_tokens)
        m = self.metrics
        outcome, reason = "cancelled", "abort"  # unless we get to the end
        cached = 0  # prompt tokens from the prefill prefix cache (known from the first token)
        first = None  # the first token: it carries the start's cache and transfer figures
        m.in_flight.inc()
        m.num_requests_waiting.inc()
        try:
            async with aclosing(self.dispatcher.generate(req.job, clock, req.fork, start)) as events:
                async for event in events:
                    if isinstance(event, Done):
                        tail = text.flush()  # a stop string can complete only in the flushed text too
                        # set before the yield: the consumer may close us right after it
                        outcome, reason = "ok", "stop" if text.stopped else event.finish_reason
                        yield Finished(reason, tail, len(req.job.prompt_ids), len(token_times), event.cached_tokens)
                        return
                    if event.index == 0:
                        cached, first = event.cached_tokens, event
                    delta = TokenDelta(event.id, event.index, text.push(event.id), event.logprob, event.prompt_logprobs)
                    self._observe_token(token_times, clock, len(req.job.prompt_ids), first, req.job.request_id)
                    if text.stopped:
                        outcome, reason = "ok", "stop"
                        yield delta
                        yield Finished("stop", "", len(req.job.prompt_ids), len(token_times), cached)
                        return
                    yield delta
        except BackendError as e:
            outcome = _OUTCOME.get(e.code, "error")
            raise
        except Exception:
            outcome = "error"
            raise
        finally:
            m.in_flight.dec()
            (m.num_requests_running if token_times else m.num_requests_waiting).dec()
            m.requests.labels(outcome).inc()
            if outcome in ("ok", "cancelled"):
                m.request_success.labels(m.model_name, reason).inc()
            if outcome == "ok":
                e2e = time.perf_counter() - clock.start
                m.e2e.observe(e2e)
                m.e2e_request_latency.observe(e2e)
                if len(token_times) > 1:
                    m.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def _observe_token(self, token_times: list[float], clock: TtftClock, prompt_tokens: int, first: Token | None,
                       request_id: str) -> None:
        m, now = self.metrics, time.perf_counter()
        m.generation_tokens.inc()
        if token_times:
            m.inter_token_latency.observe(now - token_times[-1])
        token_times.append(now)
        if len(token_times) > 1:
            return
        clock.lap("detokenize")
        m.ttft.observe(now - clock.start)
        m.time_to_first_token.observe(now - clock.start)
        for stage in TTFT_STAGES:
            m.ttft_stage.labels(stage).observe(clock.stages.get(stage, 0.0))
        first = first or Token(0, 0)
        m.recent_ttft.append({"id": request_id, "ttft_ms": (now - clock.start) * 1e3,
                              "stages_ms": {k: clock.stages.get(k, 0.0) * 1e3 for k in TTFT_STAGES},
                              "cached_tokens": first.cached_tokens, "decode_cached_tokens": first.decode_cached_tokens,
                              "transfer_bytes": first.transfer_bytes})
        m.request_queue_time.observe(sum(clock.stages.get(stage, 0.0) for stage in QUEUE_STAGES))
        m.prompt_tokens.inc(prompt_tokens)
        m.prefix_cache_queries.inc(prompt_tokens)
        m.prefix_cache_hits.inc(first.cached_tokens)
        m.num_requests_waiting.dec()
        m.num_requests_running.inc()
