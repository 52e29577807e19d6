"""pstar_fx.data: tokens from each source (stdlib, text file, folder, token file, tokenizer), batches, checks."""

import numpy as np
import pytest
import torch

from pstar_fx import data
from pstar_fx.data import batches, check_vocab, held_out, read_tokens, stdlib_tokens, text_files


def word_tokenizer(path, words=("the", "cat", "sat", "on", "mat", "a", "dog")):
    """A WordLevel tokenizer made here (no network), saved as a transformers tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>").save_pretrained(str(path))
    return path


def test_stdlib_tokens_are_bytes_and_deterministic():
    a = stdlib_tokens(max_bytes=100_000)
    assert a.dtype == torch.uint8 and a.numel() == 100_000
    assert torch.equal(a, stdlib_tokens(max_bytes=100_000))
    assert bytes(a[:2000].tolist()).isascii()  # Python source: mostly ASCII, certainly at the start
    with pytest.raises(ValueError, match="max_bytes"):
        stdlib_tokens(max_bytes=0)


def test_batches_shift_by_one_and_follow_the_seed():
    tokens = stdlib_tokens(max_bytes=50_000)
    idx, tgt = next(batches(tokens, batch=4, seq=32, seed=1))
    assert idx.shape == tgt.shape == (4, 32) and idx.dtype == tgt.dtype == torch.int64
    assert torch.equal(idx[:, 1:], tgt[:, :-1])
    windows = tokens.long().unfold(0, 33, 1)  # every 33 consecutive tokens
    for row_idx, row_tgt in zip(idx, tgt):
        assert (windows == torch.cat([row_idx, row_tgt[-1:]])).all(dim=1).any()
    again = batches(tokens, batch=4, seq=32, seed=1)
    first, second = next(again), next(again)
    assert torch.equal(first[0], idx) and not torch.equal(second[0], idx)
    assert not torch.equal(next(batches(tokens, batch=4, seq=32, seed=2))[0], idx)
    with pytest.raises(ValueError, match="tokens"):
        next(batches(tokens[:10], batch=2, seq=32))


def test_a_text_file_is_its_bytes(tmp_path):
    text = "héllo, world\n" * 20
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    tokens = read_tokens(tmp_path / "a.txt")
    assert tokens.dtype == torch.uint8 and bytes(tokens.tolist()) == text.encode("utf-8")


def test_a_folder_is_its_text_files_recursively_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    files = {"b/z.md": "zz", "b/a.py": "print(1)\n", "a.txt": "first\n", "c.rst": "rst"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "image.png").write_bytes(b"\x89PNG")            # not text: skipped
    (tmp_path / ".hidden.txt").write_text("hidden")             # hidden: skipped
    (tmp_path / ".git" / "notes.txt").write_text("git")
    assert [p.relative_to(tmp_path).as_posix() for p in text_files(tmp_path)] == ["a.txt", "b/a.py", "b/z.md", "c.rst"]
    tokens = read_tokens(tmp_path)
    assert bytes(tokens.tolist()) == b"first\nprint(1)\nzzrst"


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_a_token_file_is_memory_mapped_and_batches_like_a_tensor(tmp_path, dtype):
    ids = (np.arange(5000) * 7919 % 60000).astype(dtype)
    ids.tofile(tmp_path / "train.bin")
    tokens = read_tokens(tmp_path / "train.bin", dtype=dtype)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.dtype(dtype)
    assert np.array_equal(tokens, ids)
    as_tensor = torch.from_numpy(ids.astype(np.int64))
    got, want = batches(tokens, 3, 16, seed=5), batches(as_tensor, 3, 16, seed=5)
    for _ in range(3):
        (gi, gt), (wi, wt) = next(got), next(want)
        assert gi.dtype == torch.int64 and torch.equal(gi, wi) and torch.equal(gt, wt)
    train, held = held_out(tokens)
    assert len(held) == 250 and len(train) == 4750 and np.array_equal(held, ids[4750:])


def test_a_dat_file_is_token_ids_and_text_must_be_utf8(tmp_path):
    ids = np.arange(300, dtype=np.uint16)
    ids.tofile(tmp_path / "ids.dat")
    assert np.array_equal(read_tokens(tmp_path / "ids.dat"), ids)
    (tmp_path / "odd.dat").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        read_tokens(tmp_path / "odd.dat")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("fine")
    (tmp_path / "docs" / "b.md").write_bytes("héllo".encode("latin-1"))      # é as one byte, 0xe9: not UTF-8
    with pytest.raises(ValueError, match=r"b\.md is not UTF-8 text: byte 0xe9 at offset 1 "):
        read_tokens(tmp_path / "docs")


def test_token_file_errors(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        read_tokens(tmp_path / "odd.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        read_tokens(tmp_path / "empty.bin")
    with pytest.raises(ValueError, match="choose from uint16, uint32"):
        read_tokens(tmp_path / "odd.bin", dtype="int8")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_tokens(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_tokens(tmp_path / "empty.txt")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "x.csv").write_text("1,2")
    with pytest.raises(ValueError, match=r"no text files \(\*.txt"):
        read_tokens(tmp_path / "nothing")


def test_check_vocab_names_the_first_token_out_of_range_across_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SCAN_ELEMS", 100)                 # a file read in pieces, as a big one would be
    ids = np.full(1000, 3, dtype=np.uint16)
    ids[345], ids[900] = 256, 300
    ids.tofile(tmp_path / "t.bin")
    tokens = read_tokens(tmp_path / "t.bin")
    check_vocab(tokens, 301)
    with pytest.raises(ValueError, match="token 256 at position 345 is outside the model's vocabulary "
                                         r"\(vocab_size 256\)"):
        check_vocab(tokens, 256)
    check_vocab(torch.tensor([0, 255]), 256)


def test_a_tokenizer_directory_encodes_text_and_separates_files(tmp_path):
    tok = data.load_tokenizer(word_tokenizer(tmp_path / "tok"))
    assert data.vocab_size(tok) == 9 and data.vocab_size(None) == 256
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "1.txt").write_text("the cat sat on the mat")
    (tmp_path / "docs" / "2.txt").write_text("a dog sat")
    ids = read_tokens(tmp_path / "docs", tok)
    assert ids.dtype == torch.int64
    assert ids.tolist() == [2, 3, 4, 5, 2, 6, 1, 7, 8, 4]        # words in vocabulary order; <eos> between files
    assert read_tokens(tmp_path / "docs" / "2.txt", tok).tolist() == [7, 8, 4]
    with pytest.raises(ValueError, match="token ids already"):
        read_tokens(_bin(tmp_path), tok)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        data.load_tokenizer(tmp_path / "no-such-tokenizer")


def _bin(tmp_path):
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "x.bin")
    return tmp_path / "x.bin"
