"""One completion as both fronts see it: token and text deltas, then how it finished.

``CompletionRunner.run`` wraps the dispatcher's token stream with the text rules of
textstream.py and records what the client experiences: TTFT, time per output token, end-to-end
latency, in-flight requests, and the outcome counter. It stops the backend stream itself when a
stop string ends the text (closing the dispatcher's generator cancels the decode stream).
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc

from services.router.backend import BackendError, Done, Job
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.stages import TTFT_STAGES, TtftClock
from services.router.textstream import TextAssembler

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

    async def run(self, req: CompletionRequest, arrived: float | None = None) -> AsyncIterator[TokenDelta | Finished]:
        """``arrived``: when the request reached the router (perf_counter; default now), where
        TTFT and its breakdown start."""
        clock = TtftClock(arrived)
        clock.lap("parse")
        token_times: list[float] = []
        text = TextAssembler(self.tokenizer, req.stop, req.stop_token_ids, req.include_stop, req.skip_special_tokens)
        outcome = "cancelled"  # unless we get to the end
        cached = 0  # prompt tokens from the prefill prefix cache (known from the first token)
        self.metrics.in_flight.inc()
        try:
            async with aclosing(self.dispatcher.generate(req.job, clock)) as events:
                async for event in events:
                    if isinstance(event, Done):
                        outcome = "ok"  # set before the yield: the consumer may close us right after it
                        tail = text.flush()  # a stop string can complete only in the flushed text too
                        yield Finished("stop" if text.stopped else event.finish_reason, tail, len(req.job.prompt_ids),
                                       len(token_times), event.cached_tokens)
                        return
                    if event.index == 0:
                        cached = event.cached_tokens
                    delta = TokenDelta(event.id, event.index, text.push(event.id), event.logprob, event.prompt_logprobs)
                    token_times.append(time.perf_counter())
                    if len(token_times) == 1:
                        clock.lap("detokenize")
                        self.metrics.ttft.observe(token_times[0] - clock.start)
                        for stage in TTFT_STAGES:
                            self.metrics.ttft_stage.labels(stage).observe(clock.stages.get(stage, 0.0))
                    if text.stopped:
                        outcome = "ok"
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
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(outcome).inc()
            if outcome == "ok":
                self.metrics.e2e.observe(time.perf_counter() - clock.start)
                if len(token_times) > 1:
                    self.metrics.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))
