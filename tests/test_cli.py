"""The command line: pack, inspect, bench, demo, and the entry points.

The regression tests go through ``aioloader.__main__.main``, the console script's entry,
so they exercise exactly what a user runs.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aioloader.__main__ import main
from aioloader._cli.cmd_bench import BenchResult, Run, aggregate, load_factory, recommend, usable_cores
from aioloader._cli.cmd_pack import EncodeDataset
from aioloader.datasets import ImageFolder, ImageRecordDataset, SyntheticJpegDataset
from aioloader.recordio import IndexedRecordReader, unpack_header
from aioloader.transforms import CenterCrop, Compose, ToArray

try:
    from . import _rio_helpers as helpers
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import _rio_helpers as helpers  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[1]
FIX = helpers.MXNET_FIXTURES
make_tree = helpers.make_tree
Capture = pytest.CaptureFixture[str]


def one_error_line(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and all(n in lines[0] for n in needles), err


# --------------------------------------------------------------------------- entry points


def test_entry_points(tmp_path: Path) -> None:
    # (tomllib is 3.11+; the project supports 3.10)
    script = re.search(r'^aioloader = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert script is not None and load_factory(script.group(1)) is main
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "aioloader", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert ok.returncode == 0 and all(c in ok.stdout for c in ("demo", "pack", "inspect", "bench"))
    bad = subprocess.run(
        [sys.executable, "-m", "aioloader", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr
    # the pack regression end to end: a missing output folder is one line and status 2
    make_tree(tmp_path / "imgs")
    out = subprocess.run(
        [sys.executable, "-m", "aioloader", "pack", "imgs", "/no/such/dir/out.rec"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    one_error_line(out.stderr, "/no/such/dir")


def _console_script() -> list[str]:
    """The installed ``aioloader`` script; without one (a source tree never installed),
    the same call as that script makes, under its name."""
    script = Path(sys.executable).with_name("aioloader")
    if script.is_file():
        return [str(script)]
    stub = "import sys; from aioloader.__main__ import main; sys.argv[0] = 'aioloader'; sys.exit(main())"
    return [sys.executable, "-c", stub]


@pytest.mark.parametrize(
    "command,name",
    [(None, "aioloader"), ([sys.executable, "-m", "aioloader"], "python -m aioloader")],
    ids=["console-script", "dash-m"],
)
def test_usage_names_the_command_the_user_typed(tmp_path: Path, command: list[str] | None, name: str) -> None:
    run = _console_script() if command is None else command
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "LC_ALL": "C.UTF-8"}

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*run, *args], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path
        )

    top = call("--help")
    assert top.returncode == 0 and top.stdout.startswith(f"usage: {name} COMMAND"), top
    assert f"'{name} COMMAND --help'" in top.stdout
    for cmd in ("pack", "inspect", "bench", "demo"):
        sub = call(cmd, "--help")
        assert sub.returncode == 0 and sub.stdout.startswith(f"usage: {name} {cmd} "), sub
    missing = call("pack", "no-such-dir", "out.rec", "--workers", "0")
    assert missing.returncode == 2, missing
    one_error_line(missing.stderr, "pack: error: IMAGE_DIR no-such-dir does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- pack


def test_pack_in_process_then_read(tmp_path: Path, capsys: Capture) -> None:
    # --workers 0 encodes in this process; the pool is used below.
    make_tree(tmp_path / "imgs")
    out = tmp_path / "out" / "set.rec"
    out.parent.mkdir()
    assert (
        main(
            ["pack", str(tmp_path / "imgs"), str(out), "--workers", "0", "--resize", "12", "--quality", "90"]
        )
        == 0
    )
    assert sorted(p.name for p in out.parent.iterdir()) == ["set.idx", "set.lst", "set.rec"]
    folder = ImageFolder(tmp_path / "imgs")
    ds = ImageRecordDataset(out)
    assert ds.keys.tolist() == list(range(len(folder)))
    for i in range(len(ds)):
        img, label = ds[i]
        assert label == folder.labels[i] and isinstance(label, np.float32)
        assert min(img.shape[:2]) == 12
        assert ds.header(i)[2] == i
    ds.close()
    assert "packed 7 images (re-encoded as JPEG) in 3 classes" in capsys.readouterr().out

    assert main(["inspect", str(out), "--first", "2"]) == 0
    text = capsys.readouterr().out
    assert "records:  7" in text and "keys:     0 .. 6" in text
    assert "labels:   7 scalar; counts {0: 1, 1: 3, 2: 3}" in text
    assert "classes:  3" in text and "0: ant, 1: cat, 2: dog" in text
    assert "JPEG" in text and text.count("  key ") == 2


def test_pack_writes_im2rec_list(tmp_path: Path) -> None:
    make_tree(tmp_path / "imgs")
    assert main(["pack", str(tmp_path / "imgs"), str(tmp_path / "set.rec"), "--workers", "0"]) == 0
    folder = ImageFolder(tmp_path / "imgs")
    expected = [
        f"{i}\t{float(folder.labels[i]):f}\t{os.path.relpath(folder.path(i), folder.root)}\n"
        for i in range(len(folder))
    ]
    lines = (tmp_path / "set.lst").read_text().splitlines(keepends=True)
    assert lines == expected
    assert lines[0] == "0\t0.000000\tant/only.png\n" and lines[3] == "3\t1.000000\tcat/sub/c.png\n"


def test_pack_pass_through_keeps_the_original_bytes(tmp_path: Path, capsys: Capture) -> None:
    make_tree(tmp_path / "imgs")
    folder = ImageFolder(tmp_path / "imgs")
    for flag in ("--pass-through", "--no-reencode"):
        out = tmp_path / f"{flag[2:]}.rec"
        assert main(["pack", str(tmp_path / "imgs"), str(out), flag, "--workers", "0"]) == 0
        assert "stored as they are" in capsys.readouterr().out
        with IndexedRecordReader(out) as reader:
            for i in range(len(folder)):
                header, body = unpack_header(reader.read(i))
                assert body == Path(folder.path(i)).read_bytes()
                assert (header.flag, header.label, header.id) == (0, folder.labels[i], i)
    for extra in (["--resize", "8"], ["--quality", "80"]):
        with pytest.raises(SystemExit) as info:
            main(["pack", str(tmp_path / "imgs"), str(tmp_path / "x.rec"), "--pass-through", *extra])
        assert info.value.code == 2 and extra[0] in capsys.readouterr().err


def test_pack_pass_through_still_checks_every_image(tmp_path: Path, capsys: Capture) -> None:
    make_tree(tmp_path / "imgs")
    jpeg = tmp_path / "imgs" / "cat" / "b.jpg"
    jpeg.write_bytes(jpeg.read_bytes()[:-40])  # truncated: its header still parses
    out = tmp_path / "o"
    out.mkdir()
    assert main(["pack", str(tmp_path / "imgs"), str(out / "x.rec"), "--pass-through", "--workers", "0"]) == 1
    assert "b.jpg" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_pack_checks_the_output_before_reading_images(tmp_path: Path, capsys: Capture) -> None:
    make_tree(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "zz.png").write_bytes(b"garbage")  # would fail the encoding with 1
    imgs = str(tmp_path / "imgs")
    assert main(["pack", imgs, "/no/such/dir/out.rec", "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, "/no/such/dir/out.rec", "/no/such/dir does not exist")
    assert main(["pack", imgs, str(tmp_path), "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, str(tmp_path), "is a folder")
    assert main(["pack", imgs, str(tmp_path / "out.idx"), "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, "out.idx", ".idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]


def test_pack_reports_bad_image_and_leaves_nothing(tmp_path: Path, capsys: Capture) -> None:
    make_tree(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "zz.png").write_bytes(b"garbage")
    out = tmp_path / "o"
    out.mkdir()
    assert main(["pack", str(tmp_path / "imgs"), str(out / "x.rec"), "--workers", "0"]) == 1
    assert "zz.png" in capsys.readouterr().err
    assert list(out.iterdir()) == []
    # a missing IMAGE_DIR is a usage error, like every other bad path
    assert main(["pack", str(tmp_path / "nowhere"), str(out / "x.rec"), "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, "IMAGE_DIR", "nowhere does not exist")
    (tmp_path / "file.png").write_bytes(b"x")
    assert main(["pack", str(tmp_path / "file.png"), str(out / "x.rec"), "--workers", "0"]) == 2
    one_error_line(capsys.readouterr().err, "file.png is not a folder")
    (tmp_path / "empty").mkdir()
    assert main(["pack", str(tmp_path / "empty"), str(out / "x.rec"), "--workers", "0"]) == 1
    assert list(out.iterdir()) == []
    with pytest.raises(SystemExit) as info:
        main(["pack", str(tmp_path / "imgs"), str(out / "x.rec"), "--quality", "0"])
    assert info.value.code == 2


def test_encode_dataset_pickles(tmp_path: Path) -> None:
    make_tree(tmp_path)
    for kwargs in ({"resize": 8, "quality": 80}, {"pass_through": True}):
        ds = EncodeDataset(ImageFolder(tmp_path), **kwargs)  # type: ignore[arg-type]
        copy = pickle.loads(pickle.dumps(ds))
        assert copy[3] == ds[3]


def test_pack_on_the_pool_then_dataloader(tmp_path: Path) -> None:
    from aioloader import DataLoader

    make_tree(tmp_path / "imgs")
    out = tmp_path / "pool.rec"
    assert main(["pack", str(tmp_path / "imgs"), str(out), "--workers", "2", "--batch-size", "3"]) == 0
    ref = tmp_path / "ref.rec"
    assert main(["pack", str(tmp_path / "imgs"), str(ref), "--workers", "0"]) == 0
    for ext in (".rec", ".idx", ".lst"):
        assert out.with_suffix(ext).read_bytes() == ref.with_suffix(ext).read_bytes()

    ds = ImageRecordDataset(out, transform=Compose([CenterCrop(4), ToArray()]))
    with DataLoader(ds, batch_size=3, num_workers=2, collate_fn=list) as loader:
        samples = [s for batch in loader for s in batch]
    assert [float(label) for _, label in samples] == ImageFolder(tmp_path / "imgs").labels.tolist()
    for i, (img, _) in enumerate(samples):
        np.testing.assert_array_equal(img, ds[i][0])
    ds.close()


# --------------------------------------------------------------------------- inspect


def test_inspect_bad_and_raw_files(tmp_path: Path, capsys: Capture) -> None:
    assert main(["inspect", str(FIX / "raw.rec")]) == 0
    assert "records:  10" in capsys.readouterr().out
    bad = tmp_path / "bad.rec"
    bad.write_bytes(b"\0" * 16)
    assert main(["inspect", str(bad)]) == 1
    assert "magic" in capsys.readouterr().err


def test_inspect_says_when_it_was_given_the_index_or_list(tmp_path: Path, capsys: Capture) -> None:
    assert main(["inspect", str(FIX / "raw.idx")]) == 2
    one_error_line(capsys.readouterr().err, "raw.idx is an index file", f"inspect {FIX / 'raw.rec'}")
    make_tree(tmp_path / "imgs")
    assert main(["pack", str(tmp_path / "imgs"), str(tmp_path / "s.rec"), "--workers", "0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "s.lst")]) == 2
    one_error_line(capsys.readouterr().err, "s.lst is an image list file", "s.rec")
    lonely = tmp_path / "lonely.idx"
    lonely.write_text("3\t0\n")
    assert main(["inspect", str(lonely)]) == 2
    one_error_line(capsys.readouterr().err, "lonely.idx is an index file", "pass the .rec file")


def test_inspect_rejects_a_negative_first(capsys: Capture) -> None:
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(FIX / "raw.rec"), "--first", "-1"])
    assert info.value.code == 2 and "--first must be 0 or more, got -1" in capsys.readouterr().err
    assert main(["inspect", str(FIX / "raw.rec"), "--first", "0"]) == 0
    assert "first" not in capsys.readouterr().out.split("records:")[1]
    assert main(["inspect", str(FIX / "raw.rec"), "--first", "1"]) == 0
    out = capsys.readouterr().out
    assert "first 1 record:\n" in out and "first 1 records" not in out
    assert main(["inspect", str(FIX / "raw.rec"), "--first", "2"]) == 0
    assert "first 2 records:\n" in capsys.readouterr().out


# --------------------------------------------------------------------------- bench


def result(workers: int, prefetch: int, *rates: float) -> BenchResult:
    runs = [
        Run(samples_per_s=r, first_batch_s=0.1, stall_fraction=0.5, main_cpu_s_per_batch=0.001) for r in rates
    ]
    return aggregate(workers, prefetch, runs, stepped=False)


def test_aggregate_gives_medians_and_spread() -> None:
    runs = [Run(100.0, 0.2, 0.1, 0.002), Run(140.0, 0.4, 0.3, 0.004), Run(120.0, 0.3, 0.2, 0.003)]
    r = aggregate(2, 4, runs, stepped=True)
    assert (r.samples_per_s, r.rates, r.first_batch_ms) == (120.0, (100.0, 140.0, 120.0), pytest.approx(300))
    assert r.stall_fraction == pytest.approx(0.2) and r.main_cpu_ms_per_batch == pytest.approx(3)
    assert r.spread == pytest.approx(40 / 120)
    assert aggregate(2, 4, runs, stepped=False).stall_fraction is None


def test_recommend_prefers_cheapest_within_tolerance() -> None:
    results = [result(1, 2, 500), result(2, 4, 980), result(4, 8, 1000), result(2, 8, 990)]
    assert recommend(results, cores=8) == results[1]


def test_recommend_stays_within_the_usable_cores_unless_clearly_faster() -> None:
    # 4 workers on 2 cores: a better median that the noise explains is not taken...
    noisy = [result(1, 2, 500, 520, 510), result(2, 4, 900, 1000, 950), result(4, 8, 960, 1100, 1050)]
    assert recommend(noisy, cores=2).workers == 2
    # ...every repetition beating every repetition within the cores is.
    clear = [result(1, 2, 500, 520, 510), result(2, 4, 900, 1000, 950), result(4, 8, 1400, 1500, 1450)]
    assert recommend(clear, cores=2).workers == 4
    # with nothing measured within the cores, the best of what was measured
    assert recommend([result(8, 16, 10), result(4, 8, 20)], cores=2).workers == 4


def test_bench_repeats_and_reports_no_meaningless_stall(capsys: Capture) -> None:
    assert (
        main(
            [
                "bench",
                "tests._datasets:small_bench_dataset",
                "--workers",
                "0,1",
                "--batch-size",
                "8",
                "--epochs",
                "2",
                "--repeat",
                "2",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert captured.err.count("bench: repetition") == 4  # 2 settings x 2, reported as they run
    rows = [line.split() for line in captured.out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [row[0] for row in rows] == ["0", "1"]
    for row in rows:
        low, high = (float(x.replace(",", "")) for x in row[3].split("-"))
        assert low <= float(row[2].replace(",", "")) <= high  # the median lies in the range
        assert row[6] == "-"  # no consumer step: the stall share would only say 100%
    best = int(captured.out.split("recommended: num_workers=")[1].split(",")[0])
    assert best <= usable_cores()
    assert "pass --step-ms" in captured.out


def test_bench_stall_with_a_consumer_step(capsys: Capture) -> None:
    assert (
        main(
            [
                "bench",
                "tests._datasets:small_bench_dataset",
                "--workers",
                "1",
                "--batch-size",
                "8",
                "--epochs",
                "2",
                "--repeat",
                "1",
                "--max-batches",
                "4",
                "--step-ms",
                "2",
            ]
        )
        == 0
    )
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1 "))
    assert row[6].endswith("%") and 0 <= int(row[6][:-1]) <= 100


def test_bench_runs_the_public_demo_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capture
) -> None:
    monkeypatch.setenv("AIOLOADER_CACHE", str(tmp_path))
    assert load_factory("aioloader.datasets:SyntheticJpegDataset") is SyntheticJpegDataset
    assert (
        main(
            [
                "bench",
                "aioloader.datasets:SyntheticJpegDataset",
                "--workers",
                "0",
                "--batch-size",
                "4",
                "--epochs",
                "1",
                "--repeat",
                "1",
                "--max-batches",
                "1",
            ]
        )
        == 0
    )
    assert "recommended: num_workers=0" in capsys.readouterr().out
    assert len(ImageFolder(tmp_path / "demo-jpegs-1024")) == 1024


def test_bench_bad_arguments(capsys: Capture) -> None:
    assert main(["bench", "tests._datasets:no_such_factory"]) == 2
    one_error_line(capsys.readouterr().err, "no_such_factory")
    assert main(["bench", "no_colon"]) == 2
    one_error_line(capsys.readouterr().err, "MODULE:FUNCTION")
    for bad in (["--repeat", "0"], ["--workers", "-1"], ["--step-ms", "-5"], ["--workers", "x"]):
        with pytest.raises(SystemExit) as info:
            main(["bench", "tests._datasets:small_bench_dataset", *bad])
        assert info.value.code == 2 and bad[0] in capsys.readouterr().err


# --------------------------------------------------------------------------- demo


def test_demo_shows_progress_while_writing_and_reuses_the_files(tmp_path: Path, capsys: Capture) -> None:
    args = [
        "demo",
        "--images",
        "24",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--workers",
        "2",
        "--cache",
        str(tmp_path),
    ]
    assert main(args) == 0
    first = capsys.readouterr()
    assert "writing 24 JPEGs" in first.err and "24/24" in first.err
    assert "epoch 0: 24 images" in first.out and "writing" not in first.out
    assert len(ImageFolder(tmp_path / "demo-jpegs-24")) == 24
    assert main(args) == 0
    again = capsys.readouterr()
    assert "writing" not in again.err and "epoch 0: 24 images" in again.out
