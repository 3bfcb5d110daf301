"""Threads per rank (engine/parallel/threads.py): cores ÷ ranks by default, the override, the
oversubscription warning, and what `cpserve up` and the services pick."""

from __future__ import annotations

import os

import pytest

from engine.parallel import threads
from engine.parallel.threads import plan_threads, usable_cores


def test_usable_cores_is_the_affinity_capped_by_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == affinity
    cpu_max.write_text("150000 100000\n")  # docker --cpus 1.5
    assert usable_cores(cpu_max) == min(affinity, 1)
    cpu_max.write_text("50000 100000\n")  # half a core: still one
    assert usable_cores(cpu_max) == 1
    assert usable_cores(tmp_path / "absent") == affinity


@pytest.mark.parametrize("ranks,cores,want,over", [(2, 2, 1, False), (4, 2, 1, True), (2, 16, 8, False),
                                                  (3, 8, 2, False), (1, 1, 1, False)])
def test_picked_threads_share_the_cores_out(ranks, cores, want, over):
    plan = plan_threads(ranks, cores=cores)
    assert (plan.threads, plan.oversubscribed, plan.given) == (want, over, False)
    assert ("oversubscribed" in plan.describe()) == over


def test_given_threads_win_and_bad_values_are_refused():
    plan = plan_threads(2, 3, cores=2)
    assert plan.threads == 3 and plan.given and plan.oversubscribed
    assert "warning: oversubscribed — 6 threads on 2 core(s)" in plan.describe()
    with pytest.raises(ValueError, match="threads_per_rank"):
        plan_threads(2, 0)
    with pytest.raises(ValueError, match="ranks"):
        plan_threads(0)


def test_services_and_up_pick_cores_over_all_their_ranks(monkeypatch, tmp_path, capsys):
    from services.common.config import ConfigError, load_config
    from services.up import cluster_args, cluster_threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert load_config("prefill", overrides={"cp": 2}).engine_kwargs["threads_per_rank"] == 4
    assert load_config("decode", overrides={"dcp": 4}).engine_kwargs["threads_per_rank"] == 2
    assert load_config("decode", overrides={"dcp": 4, "threads_per_rank": 3}).engine_kwargs["threads_per_rank"] == 3
    with pytest.raises(ConfigError, match="threads_per_rank"):
        load_config("decode", overrides={"threads_per_rank": 0})

    # `cpserve up`: prefill CP 2 + decode DCP 2 share the machine: 8 cores ÷ 4 ranks
    assert cluster_threads(cluster_args([])) == {"prefill": 2, "decode": 2}
    assert "prefill CP 2 + decode DCP 2: 4 rank(s) × 2 thread(s) per rank on 8 usable core(s)" in capsys.readouterr().out
    assert cluster_threads(cluster_args(["--prefill-cp", "4", "--decode-dcp", "4"])) == {"prefill": 1, "decode": 1}
    # several services: cores over every service's ranks (8 ÷ (2 × 1 + 2 × 1))
    args = cluster_args(["--prefill-cp", "1", "--decode-dcp", "1", "--prefill-services", "2", "--decode-services", "2"])
    assert cluster_threads(args) == {"prefill": 2, "decode": 2}
    assert "(2 prefill and 2 decode services)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cluster_args(["--prefill-services", "0"])
    assert cluster_threads(cluster_args(["--threads-per-rank", "3"])) == {"prefill": 3, "decode": 3}
    assert "oversubscribed" in capsys.readouterr().err  # 12 threads on 8 cores
    config = tmp_path / "c.yaml"
    config.write_text("prefill:\n  cp: 2\n  threads_per_rank: 1\ndecode:\n  dcp: 2\n")
    assert cluster_threads(cluster_args(["--config", str(config)])) == {"prefill": None, "decode": 2}
