"""Dataset builders, read from real files written in each dataset's own format."""

from __future__ import annotations

import hashlib
import pickle
import random
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch.utils.data import Subset

from lbt.data import (
    InMemoryDataset,
    build_cifar10,
    build_imagefolder,
    build_mnist1d,
    build_synthetic,
    split_validation,
)
from lbt.data.cifar import CIFAR10_MEAN, CIFAR10_STD
from lbt.errors import ConfigError
from lbt.paths import waiting_lock

# --- split_validation ------------------------------------------------------


def _toy(n: int) -> InMemoryDataset:
    return InMemoryDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))


def test_no_val_fraction_means_no_validation_split():
    train, test = _toy(10), _toy(4)
    splits = split_validation(train, test, 0.0, 0, num_classes=10, input_shape=[1])
    assert splits.train is train and splits.val is None and splits.test is test
    assert splits.input_shape == (1,)
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        split_validation(train, None, 0.0, 0, num_classes=10, input_shape=[1])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 300), val_fraction=st.floats(0.01, 0.99), val_seed=st.integers(0, 2**31))
def test_val_split_partitions_train(n, val_fraction, val_seed):
    n_val = round(n * val_fraction)
    if not 0 < n_val < n:
        with pytest.raises(ConfigError, match="data.val_fraction"):
            split_validation(_toy(n), _toy(3), val_fraction, val_seed, 10, (1,))
        return
    splits = split_validation(_toy(n), _toy(3), val_fraction, val_seed, 10, (1,))
    assert isinstance(splits.train, InMemoryDataset) and isinstance(splits.val, InMemoryDataset)
    assert len(splits.val) == n_val and len(splits.train) == n - n_val
    # Labels are the sample indices: train and val are disjoint and cover everything.
    assert sorted(splits.train.y.tolist() + splits.val.y.tolist()) == list(range(n))
    assert len(splits.test) == 3


def test_val_split_depends_only_on_seed():
    a = split_validation(_toy(100), None, 0.2, 7, 10, (1,))
    b = split_validation(_toy(100), None, 0.2, 7, 10, (1,))
    c = split_validation(_toy(100), None, 0.2, 8, 10, (1,))
    assert torch.equal(a.val.y, b.val.y)
    assert not torch.equal(a.val.y, c.val.y)


def test_val_split_of_generic_dataset_uses_subset():
    train = [(i, i) for i in range(10)]  # any map-style dataset
    splits = split_validation(train, None, 0.3, 0, 10, (1,))
    assert isinstance(splits.train, Subset) and isinstance(splits.val, Subset)
    assert sorted(list(splits.train) + list(splits.val)) == train


@pytest.mark.parametrize("val_fraction", [-0.1, 1.0, 1.5])
def test_val_fraction_out_of_range(val_fraction):
    with pytest.raises(ConfigError, match="data.val_fraction"):
        split_validation(_toy(10), None, val_fraction, 0, 10, (1,))


# --- MNIST-1D --------------------------------------------------------------


def test_mnist1d_shapes_cache_and_global_rng(tmp_path, capsys, monkeypatch):
    random.seed(123)
    np.random.seed(123)
    py_state, np_state = random.getstate(), np.random.get_state()

    splits = build_mnist1d(num_samples=300, train_split=0.8, data_dir=str(tmp_path))

    # make_dataset reseeds both global RNGs; the builder must restore them.
    assert random.getstate() == py_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_state))
    assert "generating MNIST-1D (300 samples)" in capsys.readouterr().err

    assert splits.train.x.shape == (240, 40) and splits.train.x.dtype == torch.float32
    assert splits.train.y.shape == (240,) and splits.train.y.dtype == torch.int64
    assert splits.test.x.shape == (60, 40) and splits.val is None
    assert splits.num_classes == 10 and splits.input_shape == (40,)
    assert set(splits.train.y.tolist()) == set(range(10))

    # A second call must load the cached file, not generate again.
    (cached,) = tmp_path.glob("mnist1d_300_*.npz")
    mtime = cached.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("MNIST-1D generated again instead of loaded from the cache")

    monkeypatch.setattr("mnist1d.data.make_dataset", fail)
    again = build_mnist1d(num_samples=300, train_split=0.8, data_dir=str(tmp_path), progress=False)
    assert cached.stat().st_mtime_ns == mtime
    assert torch.equal(again.train.x, splits.train.x) and torch.equal(again.test.y, splits.test.y)
    assert capsys.readouterr().err == ""
    assert [p.name for p in tmp_path.iterdir()] == [cached.name]  # no temporary file left behind


def test_mnist1d_a_cache_another_process_is_generating_is_waited_for_not_generated_twice(tmp_path, capfd):
    build_mnist1d(num_samples=100, data_dir=str(tmp_path / "done"), progress=False)
    (made,) = (tmp_path / "done").glob("mnist1d_100_*.npz")
    mine = tmp_path / "mine"
    mine.mkdir()
    waiter = threading.Thread(target=build_mnist1d, kwargs={"num_samples": 100, "data_dir": str(mine)})
    with waiting_lock(mine / f"{made.name}.lock"):  # another process is generating this cache
        waiter.start()
        deadline = time.monotonic() + 30
        while "waiting for another process generating MNIST-1D" not in capfd.readouterr().err:
            assert time.monotonic() < deadline and waiter.is_alive()
            time.sleep(0.01)
        shutil.copy(made, mine / made.name)  # ... and publishes it
        inode = (mine / made.name).stat().st_ino
    waiter.join(timeout=30)
    assert not waiter.is_alive() and (mine / made.name).stat().st_ino == inode  # read, not generated again
    assert "generating MNIST-1D (100" not in capfd.readouterr().err


def test_mnist1d_cache_key_follows_arguments(tmp_path):
    build_mnist1d(num_samples=100, data_dir=str(tmp_path), progress=False)
    build_mnist1d(num_samples=100, data_dir=str(tmp_path), seed=1, progress=False)
    assert len(list(tmp_path.glob("mnist1d_100_*.npz"))) == 2


def test_mnist1d_val_fraction(tmp_path):
    splits = build_mnist1d(num_samples=300, train_split=0.8, data_dir=str(tmp_path), val_fraction=0.25, progress=False)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (180, 60, 60)
    again = build_mnist1d(num_samples=300, train_split=0.8, data_dir=str(tmp_path), val_fraction=0.25, progress=False)
    assert torch.equal(again.val.x, splits.val.x)
    # No validation sample is also a training sample.
    train_rows = {tuple(row) for row in splits.train.x.tolist()}
    assert not any(tuple(row) in train_rows for row in splits.val.x.tolist())


def test_mnist1d_rejects_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="data.num_samples"):
        build_mnist1d(num_samples=305, data_dir=str(tmp_path), progress=False)
    with pytest.raises(ConfigError, match="data.no_such_arg"):
        build_mnist1d(num_samples=100, data_dir=str(tmp_path), progress=False, no_such_arg=1)


# --- synthetic ---------------------------------------------------------------


@pytest.mark.parametrize("input_shape", [[40], [3, 32, 32]])
def test_synthetic_shapes_and_determinism(input_shape):
    splits = build_synthetic(num_train=64, num_test=32, input_shape=input_shape, num_classes=5, seed=3)
    assert splits.train.x.shape == (64, *input_shape) and splits.train.x.dtype == torch.float32
    assert splits.test.y.shape == (32,) and splits.test.y.dtype == torch.int64 and splits.val is None
    assert splits.input_shape == tuple(input_shape) and splits.num_classes == 5
    assert int(splits.train.y.max()) < 5
    again = build_synthetic(num_train=64, num_test=32, input_shape=input_shape, num_classes=5, seed=3)
    assert torch.equal(again.train.x, splits.train.x) and torch.equal(again.test.y, splits.test.y)


def test_synthetic_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build_synthetic()
    assert torch.equal(torch.rand(3), expected)


def test_synthetic_is_learnable():
    splits = build_synthetic()
    model = torch.nn.Linear(40, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(100):  # full batch
        loss = torch.nn.functional.cross_entropy(model(splits.train.x), splits.train.y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(splits.test.x).argmax(1) == splits.test.y).float().mean().item()
    assert accuracy > 0.6  # chance is 0.1


# --- CIFAR-10 --------------------------------------------------------------


def _write_fake_cifar10(root, per_batch: int = 4, num_test: int = 6) -> dict[str, np.ndarray]:
    """Tiny CIFAR-10 in its own on-disk format: pickled dicts of uint8 rows (n, 3072), channel-major.

    The real files were pickled by Python 2, whose str keys torchvision reads
    back as str (pickle.load(..., encoding="latin1")), so the keys are str
    here too: b"data" is only what encoding="bytes" would show.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = {}
    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", num_test)]:
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=n)]
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "labels": labels, "data": data}, f, protocol=2)
        images[name] = data
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": names, "num_cases_per_batch": per_batch, "num_vis": 3072}, f, protocol=2)
    return images


@pytest.fixture
def fake_cifar10(tmp_path, monkeypatch):
    """A tiny CIFAR-10 folder that torchvision accepts.

    torchvision's CIFAR10 checks each file against the md5 of the real
    dataset (class attributes `train_list`, `test_list`, `meta`). Rather than
    switching the check off, we point those attributes at the md5 sums of our
    files, so the real integrity check runs and passes, and a corrupted file
    still fails it.
    """
    from torchvision.datasets import CIFAR10

    images = _write_fake_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"

    def md5(name):
        return hashlib.md5((folder / name).read_bytes()).hexdigest()

    monkeypatch.setattr(CIFAR10, "train_list", [[n, md5(n)] for n, _ in CIFAR10.train_list])
    monkeypatch.setattr(CIFAR10, "test_list", [[n, md5(n)] for n, _ in CIFAR10.test_list])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5("batches.meta")})
    return tmp_path, images


def _normalized(row: np.ndarray) -> torch.Tensor:
    image = torch.from_numpy(row).float().div(255).view(3, 32, 32)
    return (image - torch.tensor(CIFAR10_MEAN).view(3, 1, 1)) / torch.tensor(CIFAR10_STD).view(3, 1, 1)


def test_cifar10_from_files(fake_cifar10):
    root, images = fake_cifar10
    splits = build_cifar10(str(root))
    assert (len(splits.train), splits.val, len(splits.test)) == (20, None, 6)
    assert splits.num_classes == 10 and splits.input_shape == (3, 32, 32)
    x, y = splits.train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)
    # Evaluation images are only normalized.
    x, _ = splits.test[0]
    torch.testing.assert_close(x, _normalized(images["test_batch"][0]))


def test_cifar10_val_split_is_not_augmented(fake_cifar10):
    root, images = fake_cifar10
    splits = build_cifar10(str(root), val_fraction=0.25, augment=True)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (15, 5, 6)
    train_rows = np.concatenate([images[f"data_batch_{i}"] for i in range(1, 6)])
    index = splits.val.indices[0]
    torch.testing.assert_close(splits.val[0][0], _normalized(train_rows[index]))
    assert not set(splits.val.indices) & set(splits.train.indices)


def test_cifar10_missing_folder(tmp_path):
    with pytest.raises(ConfigError, match="CIFAR-10 not found") as info:
        build_cifar10(str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in str(info.value) and "\n" not in str(info.value)


def test_cifar10_corrupted_file(fake_cifar10):
    root, _ = fake_cifar10
    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"truncated")
    with pytest.raises(ConfigError, match="incomplete or corrupted"):
        build_cifar10(str(root))


# --- ImageFolder -------------------------------------------------------------


def _write_image_folder(root, splits=("train", "val"), classes=("cat", "dog"), per_class: int = 3):
    rng = np.random.default_rng(0)
    for split in splits:
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")


def test_imagefolder_train_and_val(tmp_path):
    _write_image_folder(tmp_path)
    splits = build_imagefolder(str(tmp_path), image_size=8)
    assert (len(splits.train), splits.val, len(splits.test)) == (6, None, 6)
    assert splits.num_classes == 2 and splits.input_shape == (3, 8, 8)
    for dataset in (splits.train, splits.test):
        x, y = dataset[0]
        assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y in (0, 1)


def test_imagefolder_without_val_folder(tmp_path):
    _write_image_folder(tmp_path, splits=("train",), per_class=4)
    with pytest.raises(ConfigError, match="data.val_fraction"):
        build_imagefolder(str(tmp_path), image_size=8)
    splits = build_imagefolder(str(tmp_path), image_size=8, val_fraction=0.25)
    assert (len(splits.train), len(splits.val), splits.test) == (6, 2, None)
    assert splits.val[0][0].shape == (3, 8, 8)


def test_imagefolder_missing_root(tmp_path):
    with pytest.raises(ConfigError) as info:
        build_imagefolder(str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in str(info.value) and "\n" not in str(info.value)


def test_imagefolder_class_mismatch(tmp_path):
    _write_image_folder(tmp_path, splits=("train",))
    _write_image_folder(tmp_path, splits=("val",), classes=("cat",))
    with pytest.raises(ConfigError, match="class folders differ"):
        build_imagefolder(str(tmp_path), image_size=8)


# --- training from files, through the code `lbt train` runs ------------------


def _trained_two_steps(run_dir, overrides):
    from conftest import compose_config

    from lbt.engine import make_spec, run

    config, recipe = compose_config(["trainer.progress=false", "trainer.device=cpu", "trainer.max_steps=2",
                                     "trainer.epochs=1", *overrides])
    result = run(make_spec(config, recipe), run_dir).to_json()
    assert result["steps"] == 2 and result["samples_seen"] == 2 * result["global_batch"]
    assert np.isfinite(result["final_train_loss"]) and result["eval_split"] == "val"
    assert 0.0 <= result["final_val_acc"] <= 1.0 and 0.0 <= result["test_acc"] <= 1.0
    assert (run_dir / "final_model.pt").exists()
    return result


@pytest.mark.slow
def test_train_two_steps_from_cifar10_files(fake_cifar10, tmp_path):
    root, _ = fake_cifar10
    result = _trained_two_steps(tmp_path / "run", [
        "data=cifar10", f"data.root={root}", "model=resnet20", "model.width=4",
        "dist.world_size=2", "trainer.per_worker_batch=4",
    ])
    assert result["world_size"] == 2 and result["global_batch"] == 8


@pytest.mark.slow
def test_train_two_steps_from_an_image_folder(tmp_path):
    _write_image_folder(tmp_path / "images", per_class=6)  # 12 images: 1 held out for val, 2 steps of 4
    result = _trained_two_steps(tmp_path / "run", [
        "data=imagefolder", f"data.root={tmp_path / 'images'}", "data.image_size=16",
        "model=torchvision", "model.name=resnet18", "trainer.global_batch=4",
    ])
    assert result["global_batch"] == 4


def _batches_read_by_a_loader_worker() -> list[int]:
    from torch.utils.data import TensorDataset

    from lbt.data.batches import eval_batches

    dataset = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    return [int(y.sum()) for _, y in eval_batches(dataset, 0, 1, 4, torch.device("cpu"), 1, torch.contiguous_format)]


@pytest.mark.slow
def test_loader_workers_start_inside_a_joblib_worker():
    """hydra/launcher=local_parallel runs each job in a joblib (loky) worker, whose default start method
    DataLoader's workers cannot use: every job of a sweep on a file-backed dataset (data=tokens) failed."""
    from joblib import Parallel, delayed

    assert Parallel(n_jobs=2)(delayed(_batches_read_by_a_loader_worker)() for _ in range(2)) == [[6, 22, 17]] * 2


def test_a_dataset_larger_than_memory_is_refused_before_generating(tmp_path, capfd):
    """`lbt train model=mlp data.num_samples=100000000000` is refused, not generated in memory for ~10 minutes."""
    from test_cli_errors import run_main

    code, err = run_main(["train", "model=mlp", "data.num_samples=100000000000", f"data.data_dir={tmp_path}",
                          f"hydra.run.dir={tmp_path / 'run'}"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "lbt: error: data.num_samples=100,000,000,000: generating it needs" in \
        lines[0], err
    assert not list(tmp_path.glob("*.npz"))


def test_a_stop_while_generating_data_ends_at_once_and_publishes_nothing(tmp_path, capfd, monkeypatch):
    """SIGTERM during MNIST-1D's generation ends the run at once, publishing nothing: it does not wait for the
    run's first step, after the generator is done. The generator here takes a minute, unless stopped."""
    import os
    import signal

    import mnist1d.data
    from test_cli_errors import run_main

    def a_minute_long(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)

    monkeypatch.setattr(mnist1d.data, "make_dataset", a_minute_long)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # this test process's, should the stop miss
    started = time.perf_counter()
    try:
        code, err = run_main(["train", "model=mlp", "data.num_samples=1000", f"data.data_dir={tmp_path}",
                              "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"], capfd)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert time.perf_counter() - started < 30
    assert code == 143 and "lbt: stopped (SIGTERM)" in err, err
    assert not list(tmp_path.glob("*.npz"))
