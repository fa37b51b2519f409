"""aioloader.datasets and the pack/inspect commands."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from aioloader._cli_pack import EncodeDataset, _find_loader, inspect_main, pack_main
from aioloader.datasets import (
    ImageDecodeError,
    ImageFolder,
    ImageRecordDataset,
    RecordFileDataset,
)
from aioloader.errors import RecordIOError
from aioloader.recordio import IndexedRecordReader, IndexedRecordWriter, IRHeader, pack_header
from aioloader.transforms import CenterCrop, Compose, ToArray

try:
    from . import _rio_helpers as helpers
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import _rio_helpers as helpers  # type: ignore[no-redef]

FIX = helpers.MXNET_FIXTURES
MANIFEST: dict[str, Any] = json.loads((FIX / "manifest.json").read_text())


def solid(path: Path, size: tuple[int, int], color: tuple[int, int, int], mode: str = "RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img = Image.new("RGB", size, color)
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path)


def make_tree(root: Path) -> dict[str, list[str]]:
    """Three classes, nested folders, a grayscale PNG and files that must be skipped."""
    layout = {
        "cat": ["a.png", "b.jpg", "sub/c.png"],
        "dog": ["x.PNG", "y.png"],
        "ant": ["only.png"],
    }
    for i, (cls, files) in enumerate(sorted(layout.items())):
        for j, name in enumerate(files):
            solid(root / cls / name, (10 + j, 8 + i), (40 * i, 20 * j, 200))
    solid(root / "dog" / "gray.png", (6, 5), (90, 90, 90), mode="L")
    layout["dog"].insert(0, "gray.png")
    (root / "cat" / "README.txt").write_text("not an image")
    (root / "cat" / ".hidden.png").write_bytes(b"")
    (root / ".cache").mkdir()
    (root / "loose.png").write_bytes(b"")  # files directly in root are not a class
    return layout


# --------------------------------------------------------------------------- ImageFolder


def test_image_folder_layout(tmp_path: Path) -> None:
    make_tree(tmp_path)
    ds = ImageFolder(tmp_path)
    assert ds.classes == ["ant", "cat", "dog"]
    assert ds.class_to_idx == {"ant": 0, "cat": 1, "dog": 2}
    rel = [os.path.relpath(ds.path(i), tmp_path) for i in range(len(ds))]
    assert rel == [
        "ant/only.png",
        "cat/a.png",
        "cat/b.jpg",
        "cat/sub/c.png",
        "dog/gray.png",
        "dog/x.PNG",
        "dog/y.png",
    ]
    assert ds.labels.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert isinstance(ds.labels, np.ndarray)


def test_image_folder_samples(tmp_path: Path) -> None:
    make_tree(tmp_path)
    ds = ImageFolder(tmp_path)
    img, label = ds[1]
    assert label == 1 and isinstance(label, int)
    assert img.shape == (9, 10, 3) and img.dtype == np.uint8 and img.flags.writeable
    assert (img == np.array([40, 0, 200], np.uint8)).all()
    gray, label = ds[4]
    assert gray.shape == (5, 6, 3) and label == 2 and (gray == 90).all()
    assert ds[-1][1] == 2
    with pytest.raises(IndexError):
        ds[len(ds)]
    seen: list[Any] = []
    ds_t = ImageFolder(tmp_path, transform=lambda im: seen.append(im) or im.size)
    assert ds_t[0] == ((10, 8), 0)
    assert isinstance(seen[0], Image.Image) and seen[0].mode == "RGB"


def test_image_folder_bad_files_name_their_path(tmp_path: Path) -> None:
    make_tree(tmp_path)
    broken = tmp_path / "cat" / "broken.jpg"
    broken.write_bytes(b"\xff\xd8 this is not really a jpeg")
    ds = ImageFolder(tmp_path)
    pos = [ds.path(i) for i in range(len(ds))].index(str(broken))
    with pytest.raises(ImageDecodeError) as info:
        ds[pos]
    assert isinstance(info.value, OSError)
    assert str(broken) in str(info.value) and info.value.path == str(broken)
    assert info.value.__cause__ is not None
    # With every file taken, a text file is reported the same way.
    everything = ImageFolder(tmp_path, extensions=None)
    readme = [everything.path(i) for i in range(len(everything))].index(
        str(tmp_path / "cat" / "README.txt")
    )
    with pytest.raises(OSError, match=r"README\.txt"):
        everything[readme]
    # A truncated image too.
    data = (tmp_path / "cat" / "b.jpg").read_bytes()
    (tmp_path / "cat" / "b.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageDecodeError, match=r"b\.jpg"):
        ImageFolder(tmp_path)[2]


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ImageFolder(tmp_path / "missing")
    (tmp_path / "flat.png").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no class folders"):
        ImageFolder(tmp_path)


def test_image_folder_is_cheap_to_pickle(tmp_path: Path) -> None:
    for c in range(4):
        d = tmp_path / f"class_{c}"
        d.mkdir()
        for i in range(250):
            (d / f"image_{i:05d}.jpg").write_bytes(b"")
    ds = ImageFolder(tmp_path)
    assert len(ds) == 1000
    blob = pickle.dumps(ds)
    # About the relative paths' bytes plus 16 bytes a sample: no per-sample objects.
    as_list = pickle.dumps([(ds.path(i), int(ds.labels[i])) for i in range(len(ds))])
    assert len(blob) < min(50_000, len(as_list))
    copy = pickle.loads(blob)
    assert copy.path(777) == ds.path(777) and copy.labels.tolist() == ds.labels.tolist()
    big_lists = [v for v in vars(ds).values() if isinstance(v, list) and len(v) >= 100]
    assert big_lists == []


# --------------------------------------------------------------------------- record datasets


def test_record_file_dataset_on_mxnet_fixture() -> None:
    ds = RecordFileDataset(FIX / "raw.rec")
    assert len(ds) == 10
    for i, entry in enumerate(MANIFEST["raw"]):
        assert hashlib.sha256(ds[i]).hexdigest() == entry["sha256"]
    assert ds[-8] == b"hello recordio"
    with pytest.raises(IndexError):
        ds[10]
    blob = pickle.dumps(ds)
    assert len(blob) < 600
    copy = pickle.loads(blob)
    assert copy[2] == b"hello recordio"
    copy.close()
    ds.close()


def test_image_record_dataset_on_mxnet_fixture() -> None:
    ds = ImageRecordDataset(FIX / "images.rec")
    assert len(ds) == len(MANIFEST["images"])
    reader = IndexedRecordReader(FIX / "images.rec")
    for i, entry in enumerate(MANIFEST["images"]):
        img, label = ds[i]
        assert img.shape == (entry["height"], entry["width"], 3) and img.dtype == np.uint8
        jpeg = reader.read(entry["key"])[24 + 4 * entry["mxnet_flag"] :]
        expected = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        np.testing.assert_array_equal(img, expected)
        if isinstance(entry["label"], list):
            assert isinstance(label, np.ndarray) and label.dtype == np.float32
            assert label.tolist() == entry["label"]
        else:
            assert isinstance(label, np.float32) and label == entry["label"]
        flag, _, ident, ident2 = ds.header(i)
        assert (flag, ident, ident2) == (entry["mxnet_flag"], entry["id"], entry["id2"])
    reader.close()
    t = ImageRecordDataset(FIX / "images.rec", transform=Compose([CenterCrop(8), ToArray()]))
    img, _ = t[0]
    assert img.shape == (8, 8, 3)
    copy = pickle.loads(pickle.dumps(t))
    np.testing.assert_array_equal(copy[0][0], img)
    for d in (ds, t, copy):
        d.close()


def test_image_record_dataset_bad_records(tmp_path: Path) -> None:
    rec = tmp_path / "bad.rec"
    with IndexedRecordWriter(rec) as writer:
        writer.write(40, pack_header(IRHeader(0, 1.0, 0, 0), b"definitely not an image"))
        writer.write(41, b"short")
    ds = ImageRecordDataset(rec)
    with pytest.raises(ImageDecodeError, match="key 40") as info:
        ds[0]
    assert str(rec) in str(info.value) and info.value.key == 40
    with pytest.raises(RecordIOError, match="too short") as info2:
        ds[1]
    assert info2.value.key == 41 and info2.value.path == str(rec)
    ds.close()


# --------------------------------------------------------------------------- pack / inspect


def test_pack_in_process_then_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --workers 0 encodes in this process; the pool path is tested below when the
    # DataLoader is importable.
    make_tree(tmp_path / "imgs")
    out = tmp_path / "out" / "set.rec"
    out.parent.mkdir()
    assert pack_main([str(tmp_path / "imgs"), str(out), "--workers", "0", "--resize", "12",
                      "--quality", "90"]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["set.idx", "set.rec"]
    folder = ImageFolder(tmp_path / "imgs")
    ds = ImageRecordDataset(out)
    assert ds.keys.tolist() == list(range(len(folder)))
    for i in range(len(ds)):
        img, label = ds[i]
        assert label == folder.labels[i] and isinstance(label, np.float32)
        assert min(img.shape[:2]) == 12
        assert ds.header(i)[2] == i
    ds.close()
    assert "packed 7 images in 3 classes" in capsys.readouterr().out

    assert inspect_main([str(out), "--first", "2"]) == 0
    text = capsys.readouterr().out
    assert "records:  7" in text and "keys:     0 .. 6" in text
    assert "labels:   7 scalar; counts {0: 1, 1: 3, 2: 3}" in text
    assert "JPEG" in text and text.count("  key ") == 2


def test_pack_reports_bad_image_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_tree(tmp_path / "imgs")
    (tmp_path / "imgs" / "dog" / "zz.png").write_bytes(b"garbage")
    out = tmp_path / "o"
    out.mkdir()
    assert pack_main([str(tmp_path / "imgs"), str(out / "x.rec"), "--workers", "0"]) == 1
    assert "zz.png" in capsys.readouterr().err
    assert list(out.iterdir()) == []
    assert pack_main([str(tmp_path / "nowhere"), str(out / "x.rec"), "--workers", "0"]) == 1
    with pytest.raises(SystemExit) as info:
        pack_main([str(tmp_path / "imgs"), str(out / "x.rec"), "--quality", "0"])
    assert info.value.code == 2


def test_inspect_bad_and_raw_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_main([str(FIX / "raw.rec")]) == 0
    assert "records:  10" in capsys.readouterr().out
    bad = tmp_path / "bad.rec"
    bad.write_bytes(b"\0" * 16)
    assert inspect_main([str(bad)]) == 1
    assert "magic" in capsys.readouterr().err


def test_encode_dataset_pickles(tmp_path: Path) -> None:
    make_tree(tmp_path)
    ds = EncodeDataset(ImageFolder(tmp_path), resize=8, quality=80)
    copy = pickle.loads(pickle.dumps(ds))
    assert copy[3] == ds[3]


def test_pack_on_the_pool_then_dataloader(tmp_path: Path) -> None:
    loader_cls = _find_loader()
    if loader_cls is None:
        pytest.skip("aioloader.DataLoader is not importable yet")
    make_tree(tmp_path / "imgs")
    out = tmp_path / "pool.rec"
    assert pack_main([str(tmp_path / "imgs"), str(out), "--workers", "2", "--batch-size", "3"]) == 0
    ref = tmp_path / "ref.rec"
    assert pack_main([str(tmp_path / "imgs"), str(ref), "--workers", "0"]) == 0
    assert out.read_bytes() == ref.read_bytes()
    assert (tmp_path / "pool.idx").read_bytes() == (tmp_path / "ref.idx").read_bytes()

    ds = ImageRecordDataset(out, transform=Compose([CenterCrop(4), ToArray()]))
    loader = loader_cls(ds, batch_size=3, num_workers=2, collate_fn=list)
    try:
        samples = [s for batch in loader for s in batch]
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
    assert [float(label) for _, label in samples] == ImageFolder(tmp_path / "imgs").labels.tolist()
    for i, (img, _) in enumerate(samples):
        np.testing.assert_array_equal(img, ds[i][0])
    ds.close()
