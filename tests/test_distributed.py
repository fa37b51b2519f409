"""torch.distributed with 2 CPU ranks (gloo, torchrun --standalone): a loader without a
sampler or ``shard=`` gives each rank its share; one that cannot know warns. Then the
same inside accelerate and Lightning (the scenarios are in tests/_ddp.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import TORCH_REQUIRED_ON

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


def need(module: str) -> None:
    """Skip without ``module``, except on the Python where CI installs it: fail there."""
    if importlib.util.find_spec(module) is not None:
        return
    if sys.version_info[:2] == TORCH_REQUIRED_ON:
        pytest.fail(f'{module} is not installed; on Python 3.11 it must be (pip install -e ".[dev]")')
    pytest.skip(f"{module} is not installed")


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


def test_accelerate_prepare_and_skip_first_batches(tmp_path: Path) -> None:
    need("accelerate")
    r0, r1 = torchrun("accelerate", tmp_path)
    assert (r0["shard"], r1["shard"]) == ([0, 2], [1, 2])
    assert_shares(r0["epoch0"], r1["epoch0"])
    assert_shares(r0["epoch1"], r1["epoch1"])
    for r in (r0, r1):
        assert r["devices"] == [r["device"]]  # every batch on accelerator.device
        assert r["accelerate_skip"] == r["epoch1"][8:]  # the rest of the epoch, 2 batches in
        assert r["aioloader_skip"] == r["epoch2_planned"][8:]


def test_lightning_ddp_fit_then_resume_mid_epoch(tmp_path: Path) -> None:
    need("lightning")
    r0, r1 = torchrun("lightning", tmp_path)
    flat = [[i for b in r[key] for i in b] for r in (r0, r1) for key in ("full", "resumed")]
    full0, resumed0, full1, resumed1 = flat
    assert_shares(full0[:20], full1[:20])  # epoch 0: 5 batches of 4 a rank
    assert_shares(full0[20:], full1[20:])  # epoch 1
    assert full0[:20] != full0[20:]
    # the checkpoint was taken after step 7 (rank 0's state, loaded by both ranks)
    assert r0["resumed"] == r0["full"][7:] and r1["resumed"] == r1["full"][7:]
    assert resumed0 and resumed1
