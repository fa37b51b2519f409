"""aioloader.datasets: ImageFolder, the record-file datasets and the synthetic demo set."""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from aioloader import DataLoader
from aioloader._formats.synthetic import JpegWriter, make_synthetic_jpegs
from aioloader.datasets import (
    ImageDecodeError,
    ImageFolder,
    ImageRecordDataset,
    RecordFileDataset,
    SyntheticJpegDataset,
)
from aioloader.errors import RecordIOError
from aioloader.recordio import IndexedRecordReader, IndexedRecordWriter, IRHeader, pack_header
from aioloader.transforms import CenterCrop, Compose, ToArray

try:
    from . import _rio_helpers as helpers
except ImportError:  # tests/ is not a package: pytest put it on sys.path
    import _rio_helpers as helpers  # type: ignore[no-redef]

FIX = helpers.MXNET_FIXTURES
make_tree = helpers.make_tree
MANIFEST: dict[str, Any] = json.loads((FIX / "manifest.json").read_text())


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
    readme = [everything.path(i) for i in range(len(everything))].index(str(tmp_path / "cat" / "README.txt"))
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


# --------------------------------------------------------------------------- synthetic JPEGs


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.jpg"))}


def test_synthetic_dataset_writes_once_and_loads(tmp_path: Path) -> None:
    ds = SyntheticJpegDataset(12, root=tmp_path / "set", classes=4, progress=False)
    assert len(ds) == 12 and ds.classes == [f"class_{c:02d}" for c in range(4)]
    assert ds.labels.tolist() == sorted(k % 4 for k in range(12))
    img, label = ds[0]
    assert img.shape == (224, 224, 3) and img.dtype == np.uint8 and label == 0
    raw = SyntheticJpegDataset(12, root=tmp_path / "set", classes=4, transform=None, progress=False)
    full, _ = raw[5]
    assert 320 <= min(full.shape[:2]) and max(full.shape[:2]) <= 512
    # the second construction reused the files: same bytes, same modification times
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "set").rglob("*.jpg")}
    SyntheticJpegDataset(12, root=tmp_path / "set", classes=4, progress=False)
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.path(7) == ds.path(7)
    with pytest.raises(ValueError, match="classes"):
        SyntheticJpegDataset(3, root=tmp_path / "x", classes=4)
    with pytest.raises(ValueError, match="transform"):
        SyntheticJpegDataset(8, root=tmp_path / "x", transform="eval")  # type: ignore[arg-type]


def test_synthetic_jpegs_do_not_depend_on_who_writes_them(tmp_path: Path) -> None:
    make_synthetic_jpegs(tmp_path / "here", 10, 3, seed=7, progress=False)

    def on_two_workers(writer: JpegWriter) -> Any:
        with DataLoader(writer, 3, num_workers=2, collate_fn=list) as loader:
            yield from loader

    make_synthetic_jpegs(tmp_path / "pool", 10, 3, seed=7, progress=False, run=on_two_workers)
    here = _tree_bytes(tmp_path / "here")
    assert len(here) == 10 and here == _tree_bytes(tmp_path / "pool")
    # photo-like: noise keeps the files far from flat-colour sizes
    assert min(len(b) for b in here.values()) > 20_000
    assert not list((tmp_path / "pool").rglob(".*.tmp"))


def test_two_writers_of_one_image_do_not_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A loader that builds the next epoch ahead writes an image again while the first
    # write runs. Both writers stop just before renaming their file into place; with a
    # temporary name shared between them, the second rename found nothing to rename.
    writer = JpegWriter(tmp_path, 4, 2, seed=3)
    writer.path(1).parent.mkdir(parents=True)
    both_saved = threading.Barrier(2, timeout=30)
    real_replace = os.replace

    def replace_when_both_saved(src: Any, dst: Any) -> None:
        both_saved.wait()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_when_both_saved)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        sizes = list(ex.map(writer.__getitem__, [1, 1]))
    assert sizes[0] == sizes[1] == writer.path(1).stat().st_size > 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_synthetic_folder_rewritten_for_other_parameters(tmp_path: Path) -> None:
    root = tmp_path / "set"
    make_synthetic_jpegs(root, 12, 4, progress=False)
    first = _tree_bytes(root)
    make_synthetic_jpegs(root, 6, 2, progress=False)  # fewer images, fewer classes
    folder = ImageFolder(root)
    assert len(folder) == 6 and folder.classes == ["class_00", "class_01"]
    (root / "class_01" / ".00005.jpg.999-1.tmp").write_bytes(b"half a JPEG")  # an interrupted write
    (root / ".complete").write_text("12 4 0")  # the marker an older generator wrote
    make_synthetic_jpegs(root, 12, 4, progress=False)
    assert _tree_bytes(root) == first
    assert not list(root.rglob("*.tmp"))
