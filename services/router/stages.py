"""Where one request's time to first token goes, stage by stage (the router's TTFT breakdown).

A :class:`TtftClock` starts when the request reaches the router and is handed along the path;
each stage adds the time since the previous mark (``lap``), or a duration measured elsewhere
(``add``: the prefill service reports its own queue, compute and hand-off times, and the rest
of the Prefill RPC's time is the gRPC hop). The stages add up to the TTFT the router observes.
A retried request adds each attempt's time to the same stages.
"""

from __future__ import annotations

import time

# In path order. "decode's first step" is not one: the first token comes from prefill.
TTFT_STAGES = (
    "parse",            # arrival -> the job is built: body read, JSON, tokenize / chat template, checks
    "reserve",          # pair picked and Decode.Reserve answered (decode rows reserved)
    "prefill_queue",    # Prefill RPC in the prefill service until the engine has it (its rows claimed on decode)
    "prefill_compute",  # the prefill forwards until the first token is sampled
    "kv_transfer",      # BeginWrite renewal and every rank's KV writes into decode's rows
    "prefill_rpc",      # the Prefill RPC's time outside the service: gRPC, serialisation, the hop
    "detokenize",       # the first token back in the router -> its text delta ready to send
)


class TtftClock:
    def __init__(self, start: float | None = None):
        self.start = self.mark = time.perf_counter() if start is None else start
        self.stages: dict[str, float] = {}

    def take(self) -> float:
        """The time since the last mark, and a new mark now (the caller assigns it to stages)."""
        now = time.perf_counter()
        spent, self.mark = now - self.mark, now
        return spent

    def lap(self, stage: str) -> None:
        """Add the time since the last mark to ``stage``."""
        self.add(stage, self.take())

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + max(seconds, 0.0)
