"""data=tokens (nanoGPT's memory-mapped token files, lbt/data/tokens.py) and model=gpt (lbt/models/gpt.py):
splits, bad files, the model's shape, exact simulation, tensor parallelism and a study judged on loss."""

import json
import math
import pickle

import numpy as np
import pytest
import torch
from conftest import compose_config, final_params, relative_diff

from lbt.data.base import DataShape
from lbt.data.tokens import build_tokens, write_byte_tokens
from lbt.engine import make_spec, run
from lbt.errors import ConfigError
from lbt.models.gpt import GPT
from lbt.parallel.tensor_parallel import dense_splits

SENTENCES = ["the cat sat on the mat. ", "a dog ran far away! ", "zebras are quick, jumpy? ",
             "we love large batches. ", "vexing fjords glow. "]


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    """`lbt tokens`' folder of a 2,000-odd byte text: train.bin, val.bin (its last 10%), meta.json."""
    order = torch.randint(len(SENTENCES), (100,), generator=torch.Generator().manual_seed(0))
    root = tmp_path_factory.mktemp("tokens")
    (root / "corpus.txt").write_text("".join(SENTENCES[i] for i in order), encoding="utf-8")
    write_byte_tokens(str(root / "corpus.txt"), str(root / "data"))
    return root / "data"


def test_windows_splits_and_a_memory_mapped_file(token_dir):
    raw = np.frombuffer((token_dir.parent / "corpus.txt").read_bytes(), dtype=np.uint8).astype(np.int64)
    assert json.loads((token_dir / "meta.json").read_text())["vocab_size"] == 256
    n_val = round(0.1 * len(raw))
    assert np.array_equal(np.fromfile(token_dir / "val.bin", dtype=np.uint16), raw[-n_val:])
    data = build_tokens(str(token_dir), context=16, test_fraction=0.1)
    assert (data.num_classes, data.input_shape, data.token) == (256, (16,), "token")
    assert isinstance(data.train.tokens, np.memmap)  # never read whole
    train = raw[:-n_val]
    cut = len(train) - round(0.1 * len(train))  # test: train.bin's last 10%, contiguous; val: val.bin
    for split, tokens in ((data.train, train[:cut]), (data.val, raw[-n_val:]), (data.test, train[cut:])):
        assert len(split) == (len(tokens) - 1) // 16
        x, y = split[len(split) - 1]
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x[1:], y[:-1])
        assert torch.equal(y, torch.from_numpy(tokens[16 * (len(split) - 1) + 1:16 * len(split) + 1]))
    # Without val.bin: val is the tail before the test tail; eval_windows caps it, evenly spaced.
    (token_dir / "val.bin").rename(token_dir / "hidden")
    try:
        alone = build_tokens(str(token_dir), context=16, val_fraction=0.2, eval_windows=2)
        shape = build_tokens(str(token_dir), context=16, val_fraction=0.2, shape_only=True)
    finally:
        (token_dir / "hidden").rename(token_dir / "val.bin")
    val_start = len(train) - round(0.1 * len(train))
    val_start -= round(0.2 * val_start)
    assert len(alone.val) == 2 and alone.val.start == val_start and alone.val.stride > 16
    assert shape == DataShape((16,), 256, len(alone.train), token="token")
    # A pickled split (a DataLoader worker's) carries the path, not the tokens.
    assert torch.equal(pickle.loads(pickle.dumps(data.train))[3][0], data.train[3][0])
    assert pickle.loads(pickle.dumps(data.train))._tokens is None


def bad_folder(tmp_path, case: str):
    folder = tmp_path / "data"
    folder.mkdir()
    ids = np.arange(200, dtype=np.uint16) % 50
    if case == "odd size":
        (folder / "train.bin").write_bytes(ids.tobytes() + b"\0")
    elif case == "id too big":
        ids[123] = 300
        ids.tofile(folder / "train.bin")
    elif case == "short":
        ids[:20].tofile(folder / "train.bin")
    elif case == "no vocab":
        ids.tofile(folder / "train.bin")
    return folder


@pytest.mark.parametrize("case, kwargs, expected", [
    ("odd size", {}, "train.bin has 401 bytes, not a whole number of data.dtype=uint16 tokens"),
    ("id too big", {}, r"holds token id 300 \(token 123\), not below data.vocab_size=256"),
    ("short", {}, r"data.context=16 is longer than the train split .*\(16 tokens of train.bin; .*more tokens$"),
    ("short", {"context": 8, "test_fraction": 0.5}, "longer than the val split .* or a larger data.val_fraction"),
    ("missing", {}, "has no train.bin"),
    ("no vocab", {"vocab_size": None}, "data.vocab_size is not set"),
    ("no vocab", {"dtype": "int8"}, "data.dtype=int8: must be one of uint16, uint32"),
    ("no vocab", {"vocab_size": 70000}, "data.vocab_size must be an integer from 2 to 65,536"),
])
def test_bad_token_files_are_one_line(tmp_path, monkeypatch, case, kwargs, expected):
    monkeypatch.setattr("lbt.data.tokens.CHECK_CHUNK", 50)  # the id check reads in chunks: the 3rd finds it
    folder = bad_folder(tmp_path, case)
    with pytest.raises(ConfigError, match=expected) as error:
        build_tokens(str(folder), **{"context": 16, "vocab_size": 256, **kwargs})
    assert "\n" not in str(error.value)


def test_bad_input_on_the_command_line_is_one_line(tmp_path, capfd, monkeypatch, token_dir):
    from lbt.apps.cli import main

    monkeypatch.chdir(tmp_path)
    corpus = token_dir.parent / "corpus.txt"
    main(["tokens", str(corpus), "bytes", "--val-fraction", "0.2"])  # uint16: 2 bytes a token
    assert "wrote bytes: train.bin" in capfd.readouterr().out
    assert (tmp_path / "bytes" / "val.bin").stat().st_size == 2 * round(0.2 * corpus.stat().st_size)
    bad_folder(tmp_path, "id too big")
    for args in (["train", "data=tokens", "data.path=data", "data.vocab_size=256", "trainer.device=cpu"],
                 ["tokens", "nowhere.txt", "out"]):
        with pytest.raises(SystemExit) as stop:
            main(args)
        lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
        assert stop.value.code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error: "), lines


def test_gpt_is_causal_tied_and_split_by_heads_and_mlp():
    torch.manual_seed(0)
    model = GPT(input_shape=(8,), num_classes=32, n_layer=2, n_head=2, n_embd=16)
    assert model.head.weight is model.token.weight
    ids = torch.randint(32, (3, 8))
    logits = model(ids)
    assert logits.shape == (3, 32, 8)
    later = ids.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 32  # a change at position 5 leaves positions 0..4 as they were
    assert torch.allclose(model(later)[:, :, :5], logits[:, :, :5]) and not torch.allclose(model(later), logits)
    assert model(ids[:, :4]).shape == (3, 32, 4)  # shorter sequences read too
    names = {(s.name, s.style) for s in dense_splits(model)}
    assert names == {(f"blocks.{i}.{layer}", style) for i in range(2)
                     for layer, style in (("attn.qkv", "colwise"), ("attn.out", "rowwise"),
                                          ("mlp.0", "colwise"), ("mlp.3", "rowwise"))}  # the tied head stays whole


TINY = ["data=tokens", "data.context=16", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "optim=adamw",
        "optim.lr=0.003", "trainer.progress=false", "trainer.device=cpu", "trainer.threads=1",
        "trainer.loader_workers=0", "trainer.evals=2"]


def token_run(run_dir, token_dir, overrides: list[str]) -> dict:
    config, recipe = compose_config([*TINY, f"data.path={token_dir}", *overrides])
    return run(make_spec(config, recipe), run_dir).to_json()


def test_train_gpt_on_tokens_and_simulate_four_workers_exactly(tmp_path, token_dir, capsys):
    """BN-free: W=4 simulated on one process takes the steps of W=1 at 4x the batch; losses read in bits per token."""
    simulated = token_run(tmp_path / "sim", token_dir, ["dist.world_size=4", "trainer.per_worker_batch=4",
                                                        "trainer.max_steps=3"])
    saved = json.loads((tmp_path / "sim" / "result.json").read_text())
    assert saved["config"]["model"]["_target_"] == "lbt.models.GPT"  # data=tokens picks model=gpt
    assert saved["final_val_bits_per_token"] == pytest.approx(saved["final_val_loss"] / math.log(2))
    assert saved["test_bits_per_token"] == pytest.approx(saved["test_loss"] / math.log(2))
    assert " val_bits_per_token=" in capsys.readouterr().out.strip().splitlines()[-1]
    one = token_run(tmp_path / "one", token_dir, ["dist.world_size=1", "trainer.per_worker_batch=16",
                                                  "trainer.max_steps=3"])
    assert simulated["steps"] == one["steps"] == 3
    assert relative_diff(final_params(tmp_path / "one"), final_params(tmp_path / "sim")) < 1e-5
    assert simulated["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_study_judged_on_loss_reports_bits_per_token(tmp_path, token_dir):
    from lbt.apps.cli import main

    study = tmp_path / "study"
    main(["study", "study=gpu_counts", "recipe=baseline", "dist.world_size=1,2", "measure=[]",
          "hydra/launcher=basic", *TINY, f"data.path={token_dir}", "trainer.per_worker_batch=8",
          "trainer.max_steps=4", "--metric", "loss", f"hydra.sweep.dir={study}"])
    summary = json.loads((study / "summary.json").read_text())
    assert summary["metric"] == "loss" and {r["global_batch"] for r in summary["rows"]} == {8, 16}
    report = (study / "report.md").read_text()
    assert "val bits/token" in report and "bits per token" in report and "bits/char" not in report
