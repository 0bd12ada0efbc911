"""common.download, common.data and common.synthetic: genuine IDX files, offline preparation, download, learnability."""
import functools
import gzip
import hashlib
import http.server
import json
import shutil
import socket
import struct
import threading
from pathlib import Path

import pytest
import torch
import torchvision

from common.data import MNIST_MEAN, MNIST_STD, load_mnist, split_validation
from common.download import RAW_FILES, dataset_root, default_data_dir, prepare_data
from common.errors import CourseError
from common.synthetic import MARKER, write_synthetic_mnist


def read_idx(path: Path) -> tuple[int, tuple, bytes]:
    """Parse an IDX file by hand: (magic, shape, payload)."""
    blob = path.read_bytes()
    magic = struct.unpack(">I", blob[:4])[0]
    dims = blob[3]
    shape = struct.unpack(">" + "I" * dims, blob[4:4 + 4 * dims])
    return magic, shape, blob[4 + 4 * dims:]


def raw_bytes(raw: Path) -> dict:
    return {name: (raw / name).read_bytes() for name in RAW_FILES}


def assert_one_line_fix(err: CourseError, *needles: str) -> None:
    msg = str(err)
    assert "\n" not in msg and msg.strip() == msg and msg
    for needle in needles:
        assert needle in msg, (needle, msg)


# ---------------------------------------------------------------- synthetic files


def test_synthetic_files_are_genuine_idx(tmp_path):
    raw = write_synthetic_mnist(tmp_path, train_size=300, test_size=120, seed=3)
    assert raw == tmp_path / "MNIST" / "raw"
    for prefix, n in (("train", 300), ("t10k", 120)):
        magic, shape, images = read_idx(raw / f"{prefix}-images-idx3-ubyte")
        assert (magic, shape, len(images)) == (2051, (n, 28, 28), n * 784)
        assert (raw / f"{prefix}-images-idx3-ubyte").read_bytes()[:4] == b"\x00\x00\x08\x03"
        magic, shape, labels = read_idx(raw / f"{prefix}-labels-idx1-ubyte")
        assert (magic, shape, len(labels)) == (2049, (n,), n)
        assert set(labels) == set(range(10))  # every digit, in uint8
        pixels = torch.frombuffer(bytearray(images), dtype=torch.uint8).float() / 255
        assert pixels.max() == 1.0 and 0.05 < pixels.mean() < 0.3  # white strokes on mostly black
        assert (pixels.view(n, 28, 28)[:, :, :2] < 0.3).float().mean() > 0.95  # black border
    assert json.loads((raw / MARKER).read_text())["seed"] == 3
    assert not [p for p in raw.iterdir() if p.name.endswith(".tmp")]


def test_synthetic_is_deterministic_and_regenerates(tmp_path):
    a = write_synthetic_mnist(tmp_path / "a", 200, 100, seed=1)
    b = write_synthetic_mnist(tmp_path / "b", 200, 100, seed=1)
    assert raw_bytes(a) == raw_bytes(b)

    stamp = {name: (a / name).stat().st_mtime_ns for name in RAW_FILES}
    write_synthetic_mnist(tmp_path / "a", 200, 100, seed=1)  # same parameters: no-op
    assert stamp == {name: (a / name).stat().st_mtime_ns for name in RAW_FILES}

    before = raw_bytes(a)
    write_synthetic_mnist(tmp_path / "a", 200, 100, seed=2)  # other seed: new data
    after = raw_bytes(a)
    assert all(before[name] != after[name] for name in RAW_FILES)
    assert json.loads((a / MARKER).read_text())["seed"] == 2

    write_synthetic_mnist(tmp_path / "a", 500, 100, seed=2)  # other size: regenerated; a prefix-stable set
    assert len((a / "train-labels-idx1-ubyte").read_bytes()) == 8 + 500
    assert (a / "train-images-idx3-ubyte").read_bytes()[16:16 + 200 * 784] == after["train-images-idx3-ubyte"][16:]


# ---------------------------------------------------------------- loading


def test_idx_files_read_the_same_tensors_as_torchvision(synthetic_dir):
    train, _, test = load_mnist(synthetic_dir, kind="synthetic")
    assert (len(train), len(test)) == (60000, 10000)
    normalize = torchvision.transforms.Compose([torchvision.transforms.ToTensor(),
                                                torchvision.transforms.Normalize((MNIST_MEAN,), (MNIST_STD,))])
    root = dataset_root(synthetic_dir, "synthetic")
    for ours, split in ((train, True), (test, False)):
        theirs = torchvision.datasets.MNIST(root, train=split, transform=normalize, download=False)
        for i in (0, 1, 777, len(theirs) - 1):  # bit for bit, not close: the same images train the same model
            assert torch.equal(ours[i][0], theirs[i][0]) and ours[i][1] == theirs[i][1]
    raw = dataset_root(synthetic_dir, "synthetic") / "MNIST" / "raw"
    _, _, pixels = read_idx(raw / "train-images-idx3-ubyte")
    _, _, labels = read_idx(raw / "train-labels-idx1-ubyte")
    for i in (0, 1, 59999):
        x, y = train[i]
        assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and isinstance(y, int)
        assert y == labels[i]
        expected = torch.frombuffer(bytearray(pixels[i * 784:(i + 1) * 784]), dtype=torch.uint8)
        expected = (expected.float().view(1, 28, 28) / 255 - MNIST_MEAN) / MNIST_STD
        torch.testing.assert_close(x, expected)
    assert x.min().item() == pytest.approx(-MNIST_MEAN / MNIST_STD, abs=1e-5)


def test_subsets_take_the_first_examples(synthetic_dir):
    full_train, _, full_test = load_mnist(synthetic_dir, kind="synthetic")
    train, _, test = load_mnist(synthetic_dir, kind="synthetic", train_samples=100, test_samples=7)
    assert (len(train), len(test)) == (100, 7)
    for sub, full in ((train, full_train), (test, full_test)):
        for i in (0, len(sub) - 1):
            torch.testing.assert_close(sub[i][0], full[i][0])
            assert sub[i][1] == full[i][1]
    with pytest.raises(CourseError) as e:
        load_mnist(synthetic_dir, kind="synthetic", train_samples=60001)
    assert_one_line_fix(e.value, "60000")


def test_validation_split_is_disjoint_seeded_and_the_same_everywhere(synthetic_dir):
    full, _, _ = load_mnist(synthetic_dir, kind="synthetic", train_samples=1000)
    train, val, _ = load_mnist(synthetic_dir, kind="synthetic", train_samples=1000, val_samples=100, seed=3)
    again, val_again, _ = load_mnist(synthetic_dir, kind="synthetic", train_samples=1000, val_samples=100, seed=3)
    assert (len(train), len(val)) == (900, 100) and val.indices == val_again.indices and train.indices == again.indices
    assert not set(train.indices) & set(val.indices) and set(train.indices) | set(val.indices) == set(range(1000))
    assert train.indices == sorted(train.indices)  # the training images keep their order
    assert split_validation(full, 100, seed=4)[1].indices != val.indices  # another seed, another split
    assert split_validation(full, 0, seed=3) == (full, None)
    with pytest.raises(CourseError, match="--val-samples 1000 leaves no training images"):
        split_validation(full, 1000, seed=3)


def test_gz_only_folder_is_extracted(synthetic_dir, tmp_path):
    source = dataset_root(synthetic_dir, "synthetic") / "MNIST" / "raw"
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in RAW_FILES:
        (raw / f"{name}.gz").write_bytes(gzip.compress((source / name).read_bytes(), compresslevel=1))
    assert prepare_data(tmp_path, "mnist", download=False) == tmp_path
    assert raw_bytes(raw) == raw_bytes(source)
    train, _, test = load_mnist(tmp_path, download=False, train_samples=5, test_samples=5)
    assert train[4][1] == source.joinpath("train-labels-idx1-ubyte").read_bytes()[8 + 4]


def test_missing_data_without_download_names_the_fixes(tmp_path):
    with pytest.raises(CourseError) as e:
        prepare_data(tmp_path, "mnist", download=False)
    assert_one_line_fix(e.value, "--data synthetic", "download_mnist.py", str(tmp_path))
    assert not (tmp_path / "synthetic").exists()  # never a silent fallback


def test_truncated_raw_file_is_reported(synthetic_dir, tmp_path):
    source = dataset_root(synthetic_dir, "synthetic") / "MNIST" / "raw"
    shutil.copytree(source, tmp_path / "MNIST" / "raw")
    victim = tmp_path / "MNIST" / "raw" / "t10k-images-idx3-ubyte"
    victim.write_bytes(victim.read_bytes()[:1000])
    with pytest.raises(CourseError) as e:
        prepare_data(tmp_path, download=False)
    assert_one_line_fix(e.value, "truncated", "delete it")


def test_failing_main_process_still_reaches_the_barrier(tmp_path):
    calls = []
    for is_main in (True, False):
        with pytest.raises(CourseError) as e:
            load_mnist(tmp_path, is_main=is_main, barrier=lambda: calls.append(is_main), download=False)
        assert_one_line_fix(e.value, "--data synthetic", "download_mnist.py")
    assert calls == [True, False]


def test_small_helpers(monkeypatch):
    assert dataset_root("d", "mnist") == Path("d")
    assert dataset_root("d", "synthetic") == Path("d") / "synthetic"
    with pytest.raises(CourseError):
        dataset_root("d", "cifar")
    with pytest.raises(CourseError):
        prepare_data("d", "cifar")
    monkeypatch.delenv("WORKSHOP_DATA_DIR", raising=False)
    assert default_data_dir() == "./data"
    monkeypatch.setenv("WORKSHOP_DATA_DIR", "/scratch/me/data")
    assert default_data_dir() == "/scratch/me/data"


# ---------------------------------------------------------------- download through torchvision


@pytest.fixture
def http_folder(tmp_path):
    """Serve a folder over HTTP on 127.0.0.1; yields (folder, base URL without trailing slash)."""
    folder = tmp_path / "served"
    folder.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_download_from_mirror(synthetic_dir, tmp_path, http_folder, monkeypatch):
    served, url = http_folder
    source = dataset_root(synthetic_dir, "synthetic") / "MNIST" / "raw"
    resources = []
    for name in RAW_FILES:
        blob = gzip.compress((source / name).read_bytes(), compresslevel=1)
        (served / f"{name}.gz").write_bytes(blob)
        resources.append((f"{name}.gz", hashlib.md5(blob).hexdigest()))
    # torchvision checks the md5 of each .gz against the real MNIST's: expect our served files instead.
    monkeypatch.setattr(torchvision.datasets.MNIST, "resources", resources)
    monkeypatch.setenv("MNIST_MIRROR", url)
    mirrors = list(torchvision.datasets.MNIST.mirrors)

    root = prepare_data(tmp_path / "data", "mnist")
    assert torchvision.datasets.MNIST.mirrors == mirrors  # restored after the call
    assert raw_bytes(root / "MNIST" / "raw") == raw_bytes(source)
    train, _, test = load_mnist(tmp_path / "data", download=False)
    assert (len(train), len(test)) == (60000, 10000)
    assert test[9999][1] == (source / "t10k-labels-idx1-ubyte").read_bytes()[-1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["404", "closed port"])
def test_download_failure_names_the_fixes(tmp_path, http_folder, monkeypatch, where):
    url = http_folder[1] if where == "404" else f"http://127.0.0.1:{free_port()}/"
    monkeypatch.setenv("MNIST_MIRROR", url)
    mirrors = list(torchvision.datasets.MNIST.mirrors)
    with pytest.raises(CourseError) as e:
        prepare_data(tmp_path, "mnist")
    assert_one_line_fix(e.value, "--data synthetic", "download_mnist.py", "download failed")
    assert ("HTTP Error 404" if where == "404" else "Connection refused") in str(e.value)
    # offline, the fix is by hand: which four files to copy, and into which folder
    assert_one_line_fix(e.value, *(f"{name}.gz" for name in RAW_FILES), f"into {tmp_path / 'MNIST' / 'raw'}/")
    assert torchvision.datasets.MNIST.mirrors == mirrors

