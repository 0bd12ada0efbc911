"""Lesson 08's text path (08_your_model/text_data.py): documents tokenized with the course's own tokenizer
(text_model.py, written here), EOS after each, packed into blocks, cached once; PaddedSampler on 3 gloo ranks gives
every block exactly once per epoch with equal steps; each bad input is one line."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from common.errors import CourseError
from common.launcher import launch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "08_your_model"))

import text_data  # noqa: E402  (after the lesson folder is on sys.path)

LINE = "A line of prose about sharding, tokens and ranks number {}.\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import text_model
    out = tmp_path_factory.mktemp("text_model")
    text_model.write(out, vocab_size=512)
    return out


@pytest.fixture
def files(tmp_path):
    (tmp_path / "a.txt").write_text("".join(LINE.format(i) for i in range(40)))
    records = [json.dumps({"text": f"document {i}: hello"}) for i in range(3)]
    (tmp_path / "b.jsonl").write_text("\n".join(records) + "\n\n")  # a blank line at the end: skipped
    return [tmp_path / "a.txt", tmp_path / "b.jsonl"]


def blocks(paths, folder, cache_dir, seq_len=16, world_size=1):
    return text_data.text_blocks(paths, folder, seq_len, 0.2, cache_dir, True, None, world_size)


def test_documents_are_packed_with_eos_between_them_and_the_last_blocks_held_out(folder, files, tmp_path,
                                                                                 monkeypatch):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    docs = text_data.read_texts(files)
    assert len(docs) == 4 and docs[1] == "document 0: hello"
    encoded = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]  # each document in one call
    expected = [i for ids in encoded for i in ids + [tokenizer.eos_token_id]]
    monkeypatch.setattr(text_data, "CHUNK_CHARS", 200)  # a.txt is cut into pieces at line ends: one EOS at its end
    train, val, summary = blocks(files, folder, tmp_path / "cache")
    n = len(expected) // 16
    held_out = max(1, int(n * 0.2))
    assert (len(train), len(val)) == (n - held_out, held_out)
    assert torch.cat([train.tensors[0], val.tensors[0]]).flatten().tolist() == expected[:n * 16]
    assert train[0][0].dtype == torch.long and train[len(train)][0].tolist() == [-100] * 16  # the padding block
    assert (f"4 documents, {len(expected)} tokens" in summary and f"({n - held_out} train / {held_out} validation)"
            in summary and f"the last {len(expected) - n * 16} tokens dropped" in summary), summary


def test_a_second_run_reads_the_cache_and_a_changed_file_makes_a_new_one(folder, files, tmp_path, monkeypatch):
    first = blocks(files, folder, tmp_path / "cache")
    monkeypatch.setattr(text_data, "tokenize", lambda *_: pytest.fail("tokenized again"))
    again = blocks(files, folder, tmp_path / "cache")
    assert "(cached)" not in first[2] and "(cached)" in again[2]
    assert torch.equal(first[0].tensors[0], again[0].tensors[0])
    monkeypatch.undo()
    with open(files[1], "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    changed = blocks(files, folder, tmp_path / "cache")
    assert "(cached)" not in changed[2] and len(list((tmp_path / "cache").glob("text-*.pt"))) == 2


def tiny_lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))


def three_ranks_worker(n: int, epochs: int, good: list, bad: list, folder: str, cache_dir: str) -> dict:
    """Rank r of 3: text_blocks on good then bad files; PaddedSampler's indices per epoch over n blocks, its batches
    through a DataLoader into an FSDP2 model, next_token_loss's sums and the accumulated gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader
    dist.init_process_group("gloo")
    rank, calls = dist.get_rank(), []
    tokenize = text_data.tokenize
    text_data.tokenize = lambda *args: calls.append(1) or tokenize(*args)  # counts this rank's tokenizing
    out = {"text": text_data.text_blocks(good, folder, 16, 0.2, cache_dir, rank == 0, dist.barrier, 3)}
    try:
        text_data.text_blocks(bad, folder, 16, 0.2, cache_dir, rank == 0, dist.barrier, 3)
    except CourseError as exc:
        out["error"] = str(exc)
    out["tokenized"] = len(calls)
    train = text_data.TrainBlocks(torch.arange(n * 8).remainder(11).view(n, 8))
    sampler = text_data.PaddedSampler(train, seed=3)
    loader = DataLoader(train, batch_size=1, sampler=sampler)  # the last step of ranks 1 and 2: padding only
    model = fully_shard(tiny_lm(), mesh=init_device_mesh("cpu", (3,)))
    out.update({"indices": [], "steps": [], "loss": 0.0, "count": 0})
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out["indices"].append(list(sampler))
        out["steps"].append(0)
        for (tokens,) in loader:
            loss, loss_sum, count = text_data.next_token_loss(model(tokens.clamp(min=0)[:, :-1]), tokens)
            loss.backward()  # accumulated over every step: compared with one process's sum of step means
            out["loss"] += loss_sum.item()
            out["count"] += count.item()
            out["steps"][-1] += 1
    out["grads"] = [p.grad.full_tensor() for p in model.parameters()]  # a collective
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def three_ranks(folder, tmp_path_factory):
    """One launch of 3 gloo ranks; n = 10 blocks for the sampler: 4 + 3 + 3, two ranks get the padding block."""
    texts = tmp_path_factory.mktemp("texts")
    (texts / "a.txt").write_text("".join(LINE.format(i) for i in range(40)))
    (texts / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    return launch(three_ranks_worker, nprocs=3, timeout_s=240, args=(
        10, 2, [str(texts / "a.txt")], [str(texts / "bad.jsonl")], str(folder), str(texts / "cache")))


def test_the_main_rank_tokenizes_once_and_every_rank_reads_its_blocks(three_ranks):
    assert [r["tokenized"] for r in three_ranks] == [2, 0, 0]  # the good files, then the bad (failing): rank 0 only
    first = three_ranks[0]["text"]
    for r in three_ranks:
        assert torch.equal(r["text"][0].tensors[0], first[0].tensors[0]) and r["text"][2] == first[2]
        assert "(cached)" not in r["text"][2]  # every rank looked before rank 0 wrote
    assert "bad.jsonl line 2 is not JSON" in three_ranks[0]["error"]
    assert all("is missing after the main rank tokenized: see its error" in r["error"] for r in three_ranks[1:])


def test_every_block_once_per_epoch_on_three_ranks_with_equal_steps(three_ranks):
    n = 10
    for epoch in range(2):
        shards = [r["indices"][epoch] for r in three_ranks]
        assert sorted(i for shard in shards for i in shard if i != n) == list(range(n))
        assert [len(shard) for shard in shards] == [4, 4, 4] and sum(s.count(n) for s in shards) == 2
        assert len({r["steps"][epoch] for r in three_ranks}) == 1  # FSDP2: every rank the same number of forwards
    assert three_ranks[0]["indices"][0] != three_ranks[0]["indices"][1]  # a new order each epoch
    blocks, model, total = torch.arange(n * 8).remainder(11).view(n, 8), tiny_lm(), 0.0
    for epoch in range(2):  # one process: each step's blocks of every rank, the mean over their targets
        for step in range(three_ranks[0]["steps"][epoch]):
            chosen = [r["indices"][epoch][step] for r in three_ranks if r["indices"][epoch][step] != n]
            logits, targets = model(blocks[chosen, :-1]), blocks[chosen, 1:]
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
            total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
    assert abs(sum(r["loss"] for r in three_ranks) - total) < 1e-4 * total  # the padding adds no loss
    assert three_ranks[0]["count"] == 2 * n * 7  # all_reduced: every rank counts every real target
    for sharded, p in zip(three_ranks[0]["grads"], model.parameters()):
        assert (sharded - p.grad).abs().max().item() < 1e-5  # the loss x W / count under FSDP2's average


def test_too_little_text_for_the_ranks_names_the_tokens_needed(folder, files, tmp_path):
    train, _, _ = blocks(files, folder, tmp_path / "cache")
    ranks = len(train) + 1
    with pytest.raises(CourseError, match=r"fewer than one per rank \(\d+\); give at least \d+ tokens") as info:
        blocks(files, folder, tmp_path / "cache", world_size=ranks)
    need = int(str(info.value).split("give at least ")[1].split()[0])
    assert need // 16 - max(1, int(need // 16 * 0.2)) == ranks  # the fewest blocks that leave one per rank


@pytest.mark.parametrize("content, suffix, message", [
    (None, ".txt", r"a\.txt: no such file"),
    ("", ".txt", r"a\.txt is empty"),
    ("some text", ".md", r"a\.md: a \.md file: give \.txt files"),
    ('{"text": "ok"}\n{"text": ', ".jsonl", r"a\.jsonl line 2 is not JSON"),
    ('{"text": "ok"}\n\n{"body": "no text"}\n', ".jsonl", r"a\.jsonl line 3 has no string \"text\" field"),
])
def test_a_bad_text_file_is_one_line(content, suffix, message, tmp_path):
    path = tmp_path / f"a{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CourseError, match=message) as info:
        text_data.read_texts([path])
    assert "\n" not in str(info.value)


def test_a_folder_without_a_tokenizer_or_its_eos_and_a_long_seq_len_are_one_line(folder, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig
    with pytest.raises(CourseError, match=r"has no tokenizer \(tokenizer\.json / tokenizer_config\.json\): save one"):
        text_data.load_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(CourseError, match=r"its tokenizer has no eos token"):
        text_data.load_tokenizer(tmp_path)
    with pytest.raises(CourseError, match=r"--seq-len 300 is above the model's max_position_embeddings \(256\)"):
        text_data.check_seq_len(300, LlamaConfig(max_position_embeddings=256))


@pytest.mark.parametrize("seq_len, val_fraction, message", [
    (1, 0.2, r"^seq_len 1: at least 2"), (16, 1.0, r"^val_fraction 1.0: between 0 and 1")])
def test_a_bad_seq_len_or_val_fraction_is_one_line(seq_len, val_fraction, message, folder, files, tmp_path):
    with pytest.raises(CourseError, match=message):
        text_data.text_blocks(files, folder, seq_len, val_fraction, tmp_path, True, None, 1)
