"""data=text: character-level language modelling on a UTF-8 file (lbt/data/text.py), trained for real."""

import json
import math

import pytest
import torch
from conftest import compose_config

from lbt.data.base import DataShape
from lbt.data.text import build_text
from lbt.engine import make_spec, run
from lbt.errors import ConfigError

# A small text, made here: a few sentences in a fixed pseudo-random order (2,000-odd characters, 30 distinct).
SENTENCES = ["the cat sat on the mat. ", "a dog ran far away! ", "zebras are quick, jumpy? ",
             "we love large batches. ", "vexing fjords glow. "]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    order = torch.randint(len(SENTENCES), (100,), generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("".join(SENTENCES[i] for i in order), encoding="utf-8")
    return path


def test_vocabulary_windows_and_splits(text_file):
    text = text_file.read_text(encoding="utf-8")
    data = build_text(str(text_file), context=16, test_fraction=0.1, val_fraction=0.1)
    vocab = sorted(set(text))
    assert data.num_classes == len(vocab) and data.input_shape == (16,) and data.token == "char"
    ids = torch.tensor([vocab.index(c) for c in text])
    # Each sample: 16 characters, labelled with the next character at every position.
    for split in (data.train, data.val, data.test):
        assert split.x.dtype == split.y.dtype == torch.int64 and split.x.shape[1] == 16
        assert torch.equal(split.x[:, 1:], split.y[:, :-1])
    # Test: windows of the file's last 10%, contiguous; train + val: the windows before it (their labels too).
    cut = len(text) - round(0.1 * len(text))
    test_x, test_y = windows_of(ids[cut:])
    assert torch.equal(data.test.x, test_x) and torch.equal(data.test.y, test_y)
    train_x, _ = windows_of(ids[:cut])
    assert sorted(map(tuple, torch.cat([data.train.x, data.val.x]).tolist())) == sorted(map(tuple, train_x.tolist()))
    assert len(data.val) == round(0.1 * len(train_x))
    # The planner's view matches the data without building the splits.
    shape = build_text(str(text_file), context=16, test_fraction=0.1, val_fraction=0.1, shape_only=True)
    assert shape == DataShape((16,), len(vocab), len(data.train), token="char")
    # lbt plan profiles the character model on token ids of that shape.
    from lbt.apps.plan.compute import profile_compute
    from lbt.spec.targets import target_of

    model = compose_config(["data=text", "data.path=x"])[0]["model"]
    target = target_of({**model, "dim": 16, "depth": 1}, "model")
    compute = profile_compute(target, shape, per_worker_batch=4, repeats=1, warmup=0)
    assert compute.num_params > 0


def windows_of(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = (len(ids) - 1) // 16
    return ids[:n * 16].view(n, 16), ids[1:n * 16 + 1].view(n, 16)


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"), (b"", "is empty"), (b"caf\xe9 au lait", "not UTF-8"), ("short".encode(), "too short"),
])
def test_unusable_files_are_one_line_errors(tmp_path, content, expected):
    path = tmp_path / "input.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=expected) as error:
        build_text(str(path), context=16)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="is a folder"):
        build_text(str(tmp_path), context=16)


@pytest.mark.slow
def test_a_missing_file_on_the_command_line(tmp_path, capfd, monkeypatch):
    from lbt.apps.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["train", "data=text", "data.path=nowhere.txt", "trainer.device=cpu"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert stop.value.code == 2 and lines == ["lbt: error: data.path=nowhere.txt: no such file"], err


SMALL_MODEL = ["model.dim=32", "model.depth=1"]
TINY = ["data.context=16", "optim=adamw", "optim.lr=0.003", "trainer.progress=false",
        "trainer.device=cpu", "trainer.threads=1"]


def text_run(run_dir, text_file, overrides: list[str], model: list[str] = SMALL_MODEL) -> dict:
    config, recipe = compose_config(["data=text", f"data.path={text_file}", *TINY, *model, *overrides])
    return run(make_spec(config, recipe), run_dir).to_json()


def test_train_a_character_model_in_process(tmp_path, text_file, capsys):
    result = text_run(tmp_path / "run", text_file, ["trainer.per_worker_batch=8", "trainer.epochs=1"])
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["config"]["model"]["causal"] is True  # data=text picks model=char_transformer
    assert result["steps"] == saved["steps"] > 0 and math.isfinite(saved["final_val_loss"])
    assert saved["final_val_bits_per_char"] == pytest.approx(saved["final_val_loss"] / math.log(2))
    assert saved["test_bits_per_char"] == pytest.approx(saved["test_loss"] / math.log(2))
    vocab = len(set(text_file.read_text(encoding="utf-8")))
    assert saved["final_val_bits_per_char"] < math.log2(vocab)  # it learned something in one epoch
    done = capsys.readouterr().out.strip().splitlines()[-1]
    assert done.startswith("done: val_acc=") and " val_bits_per_char=" in done and " test_bits_per_char=" in done


def test_a_classification_model_is_told_to_pick_char_transformer(tmp_path, text_file):
    with pytest.raises(ConfigError, match="char_transformer"):
        text_run(tmp_path / "run", text_file, [], model=["model=mlp"])
