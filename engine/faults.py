"""Fault injection for the stress tests, inert unless ``CPSERVE_FAULTS`` is set.

``CPSERVE_FAULTS="layer_delay_s=0.004,write_fail_rate=0.05,seed=3"`` (any subset):

- ``layer_delay_s``: each prefill rank sleeps this long after storing each layer's KV, which
  widens the window in which a request can be cancelled while its cache is being computed and
  written;
- ``write_fail_rate``: each batched KV transfer write fails with this probability, after half
  of its ranges have landed (a partial write, as a broken link leaves one);
- ``decode_step_delay_s``: each decode rank sleeps this long after each decode step (a slow
  step: the window in which the decode service's commands arrive while its ranks compute);
- ``seed``: the random stream of the failures (mixed with the process id, so ranks differ).

Read once per process from the environment, so a cluster started with it set passes it to
every service and rank process it spawns.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

ENV = "CPSERVE_FAULTS"


@dataclass
class Faults:
    layer_delay_s: float = 0.0
    decode_step_delay_s: float = 0.0
    write_fail_rate: float = 0.0
    seed: int = 0
    rng: random.Random = field(default_factory=random.Random, repr=False)

    @classmethod
    def parse(cls, spec: str) -> "Faults":
        kw: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("layer_delay_s", "decode_step_delay_s", "write_fail_rate", "seed"):
                raise ValueError(f"{ENV}: {part!r} is not one of layer_delay_s=S, decode_step_delay_s=S, "
                                 "write_fail_rate=P, seed=N")
            kw[key] = int(value) if key == "seed" else float(value)
        faults = cls(**kw)
        faults.rng.seed(faults.seed * 1_000_003 + os.getpid())
        return faults

    def after_layer(self) -> None:
        if self.layer_delay_s > 0:
            time.sleep(self.layer_delay_s)

    def after_decode_step(self) -> None:
        if self.decode_step_delay_s > 0:
            time.sleep(self.decode_step_delay_s)

    def write_fails(self) -> bool:
        return self.write_fail_rate > 0 and self.rng.random() < self.write_fail_rate


_FAULTS: Faults | None = None


def faults() -> Faults:
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = Faults.parse(os.environ.get(ENV, ""))
    return _FAULTS
