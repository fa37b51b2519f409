"""torch.distributed with 2 CPU ranks (gloo, torchrun --standalone): a loader without a
sampler or ``shard=`` gives each rank its share; one that cannot know warns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "_ddp.py"
N = 40


def torchrun(scenario: str, out: Path, timeout: float = 100) -> list[dict[str, Any]]:
    """Run ``tests/_ddp.py scenario`` on 2 ranks; what each rank wrote, rank 0 first."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.Popen(
        [*cmd, str(SCRIPT), scenario, str(out)],
        cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        text = proc.communicate(timeout=timeout)[0].decode(errors="replace")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, text[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def assert_shares(a: list[int], b: list[int], n: int = N) -> None:
    """Each rank its half, no sample twice, every sample once."""
    assert len(a) == len(b) == n // 2, (a, b)
    assert not set(a) & set(b), sorted(set(a) & set(b))
    assert sorted(a + b) == list(range(n))


def test_each_rank_gets_its_share_without_a_sampler(tmp_path: Path) -> None:
    r0, r1 = torchrun("plain", tmp_path)
    assert (r0["shard"], r1["shard"]) == ([0, 2], [1, 2])
    for key in ("for", "async", "early", "seeded"):
        assert_shares(r0[key], r1[key])
    assert r0["for"] != r0["async"]  # epoch 1 has its own order
    assert r0["seeded"] != r0["for"]  # seed= still chooses the order
    for r in (r0, r1):
        assert r["early"] == r["for"]  # built before init_process_group: sharded at first use
        assert r["resumed"] == r["for"]  # rank 0's mid-epoch state resumes every rank exactly
    # an explicit DistributedSampler is applied once, as it was; shard=(0, 1) opts out
    assert_shares(r0["dsampler"], r1["dsampler"])
    assert r0["optout"] == r1["optout"] == list(range(N))
    for rank, r in enumerate((r0, r1)):
        assert not r["dsampler_warned"] and not r["optout_warned"]
        [text] = r["warned"]  # a plain sampler: it cannot know, so it says so, once
        assert f"2 ranks (this is rank {rank})" in text and f"shard=({rank}, 2)" in text
        assert "DistributedSampler" in text and "shard=(0, 1)" in text
