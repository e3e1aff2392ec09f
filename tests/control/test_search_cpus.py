"""The search's pool: its size is the container's CPU limit (cgroup v2 or v1) and
affinity, never the host's core count; work queued on it runs on workers a map leaves idle."""

from __future__ import annotations

import time

import pytest

from distserve.search import cpus, planner


@pytest.fixture
def many_cores(monkeypatch):
    """A 96-core host with every core in this process's affinity."""
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(96)), raising=False)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 96)


def test_cgroup_v2_quota_caps_the_count_rounding_up(tmp_path, many_cores):
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cpus.quota_cpus(tmp_path, "0::/\n") == 2.5
    assert cpus.usable_cpus(tmp_path, "0::/\n") == 3


def test_cgroup_v2_of_the_own_cgroup_when_not_namespaced(tmp_path, many_cores):
    own = tmp_path / "kubepods" / "pod-1" / "ctr"
    own.mkdir(parents=True)
    (own / "cpu.max").write_text("400000 100000")
    (tmp_path / "cpu.max").write_text("max 100000")  # the host's root: unlimited
    assert cpus.usable_cpus(tmp_path, "0::/kubepods/pod-1/ctr\n") == 4


def test_cgroup_v2_max_means_no_limit(tmp_path, many_cores):
    (tmp_path / "cpu.max").write_text("max 100000")
    assert cpus.quota_cpus(tmp_path, "0::/") is None
    assert cpus.usable_cpus(tmp_path, "0::/") == 96


def test_cgroup_v1_cfs_quota(tmp_path, many_cores):
    folder = tmp_path / "cpu,cpuacct"
    folder.mkdir()
    (folder / "cpu.cfs_quota_us").write_text("200000")
    (folder / "cpu.cfs_period_us").write_text("100000")
    assert cpus.usable_cpus(tmp_path, "4:cpu,cpuacct:/\n") == 2
    (folder / "cpu.cfs_quota_us").write_text("-1")
    assert cpus.usable_cpus(tmp_path, "4:cpu,cpuacct:/\n") == 96


def test_affinity_caps_the_count_when_there_is_no_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 96)
    assert cpus.usable_cpus(tmp_path / "none", "") == 3
    (tmp_path / "cpu.max").write_text("800000 100000")
    assert cpus.usable_cpus(tmp_path, "0::/") == 3  # quota 8, but only 3 CPUs allowed


def test_a_tiny_quota_still_leaves_one_worker(tmp_path, many_cores):
    (tmp_path / "cpu.max").write_text("10000 100000")
    assert cpus.usable_cpus(tmp_path, "0::/") == 1


def test_the_search_pool_takes_the_limit_not_the_host_count(monkeypatch, many_cores):
    monkeypatch.setattr(planner, "usable_cpus", lambda: 3)
    assert planner._pool(None).workers == 3
    assert planner._pool(5).workers == 5  # spec.planner.workers wins


def test_queued_work_runs_on_a_worker_a_map_leaves_idle():
    with planner._pool(2) as pmap:
        work = pmap.later(pow, [(2, k) for k in range(6)])
        assert work.next == 0  # nothing starts before a map waits
        assert pmap(time.sleep, [(0.2,)]) == [None]  # one task: one worker idle
        assert work.next >= 1  # started beside it
        assert pmap.collect(work) == [2**k for k in range(6)]  # the rest ran now
        assert not pmap.queued and pmap(pow, [(3, 2), (2, 3)]) == [9, 8]


def test_queued_work_on_one_worker_runs_when_collected():
    with planner._pool(1) as pmap:
        work = pmap.later(pow, [(2, k) for k in range(3)])
        assert pmap(pow, [(3, 2)]) == [9] and work.next == 0
        assert pmap.collect(work) == [1, 2, 4]
