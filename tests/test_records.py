"""Instruction and chat records (pstar_fx.records): masks, packing, padding, the held-out split by record, bad records;
the loss through the engine against the eager Hugging Face model with -100 labels, and `pstar-fx train --data
FILE.jsonl` end to end. A word-level tokenizer with a chat template and a tiny Llama, both made here (no network)."""
import json
import random

import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")

import torch  # noqa: E402

from pstar_fx import records  # noqa: E402
from pstar_fx.records import IGNORE_INDEX  # noqa: E402

WORDS = "the cat sat on mat a dog what did do it ran who where why yes no".split()
SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>"]
# a template in the common shape: each turn "<|role|> content <eos>", and the generation prompt "<|assistant|>"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(path=None):
    """A WordLevel tokenizer with pad, eos and role tokens and a chat template (saved to `path` if given)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"[UNK]": 0, "<eos>": 1, "<pad>": 2, **{t: i + 3 for i, t in enumerate(SPECIAL)},
             **{w: i + 3 + len(SPECIAL) for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>", pad_token="<pad>",
                                additional_special_tokens=SPECIAL)
    t.chat_template = TEMPLATE
    if path is not None:
        t.save_pretrained(str(path))
    return t


def tiny_llama(vocab=32):
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=vocab, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=1, pad_token_id=2, attention_dropout=0.0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def tiny_llama_dir(path):
    """A save_pretrained folder: the tiny Llama's weights and the chat tokenizer."""
    tiny_llama().save_pretrained(str(path))
    chat_tokenizer(path)
    return path


def sentence(rng, lo=1, hi=5):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def chat_jsonl(path, n, seed=0, bad=()):
    """n records, chat and prompt/completion alternating, then the `bad` lines."""
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        if i % 2:
            lines.append({"prompt": sentence(rng), "completion": sentence(rng)})
        else:
            turns = [{"role": "system", "content": sentence(rng)}] if i % 4 == 0 else []
            for _ in range(rng.randint(1, 2)):
                turns += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
            lines.append({"messages": turns})
    with open(path, "w") as f:
        for obj in lines:
            f.write(json.dumps(obj) + "\n")
        for line in bad:
            f.write(line + "\n")
    return path


def rows_of(path, seq, pack=True):
    tok = chat_tokenizer()
    found, problems = records.read_records(path)
    examples, problems = records.encode_records(found, tok, seq, problems)
    return (records.pack_rows if pack else records.pad_rows)(examples, seq, records.pad_id(tok)), examples


# ---- records to tokens: masks, bad records ---------------------------------------------------------------

def test_chat_records_train_on_assistant_turns_only_and_render_as_the_template_does():
    tok = chat_tokenizer()
    chat = {"messages": [{"role": "system", "content": "yes"}, {"role": "user", "content": "what did the cat do"},
                         {"role": "assistant", "content": "the cat sat"}, {"role": "user", "content": "why"},
                         {"role": "assistant", "content": "it ran"}]}
    ids, labels = records.encode_record(chat, tok)
    # the tokens are those of the whole rendering, as generation would see them
    assert ids == tok(tok.apply_chat_template(chat["messages"], tokenize=False), add_special_tokens=False)["input_ids"]
    trained = [t if lab != IGNORE_INDEX else None for t, lab in zip(tok.convert_ids_to_tokens(ids), labels)]
    assert [t for t in trained if t] == ["the", "cat", "sat", "<eos>", "it", "ran", "<eos>"]
    assert all(lab in (IGNORE_INDEX, i) for i, lab in zip(ids, labels))
    # every trained token of a turn, in order; the generation prompt "<|assistant|>" itself is not trained
    first = tok.convert_ids_to_tokens(ids).index("<|assistant|>")
    assert labels[first] == IGNORE_INDEX and labels[first + 1:first + 5] == ids[first + 1:first + 5]
    ids, labels = records.encode_record({"prompt": "who sat", "completion": "the dog"}, tok)
    assert tok.convert_ids_to_tokens(ids) == ["who", "sat", "the", "dog", "<eos>"]
    assert labels == [IGNORE_INDEX, IGNORE_INDEX, *ids[2:]]


def test_bad_records_are_counted_by_kind_and_reported_in_one_line(tmp_path):
    bad = ['{"prompt": "a"}', '{"prompt": "a", "completion": 3}', '{"prompt": "a", "completion": ""}',
           "not json", '[1, 2]', '{"messages": [{"role": "user", "content": "a"}]}',
           '{"messages": [{"role": "assistant"}]}', '{"prompt": "' + "the " * 40 + '", "completion": "a"}',
           '{"prompt": "b"}']
    path = chat_jsonl(tmp_path / "mixed.jsonl", 6, bad=bad)
    found, problems = records.read_records(path)
    examples, problems = records.encode_records(found, chat_tokenizer(), 32, problems)
    assert len(examples) == 6 and problems.total() == len(bad)
    assert problems.counts == {"missing keys": 3, "non-string": 1, "empty completion": 2, "not JSON": 1,
                               "not a JSON object": 1, "longer than --seq 32": 1}
    summary = problems.summary()
    assert summary.startswith("9 bad records skipped: 3 missing keys (first at line 7)") and "\n" not in summary
    assert "1 not JSON (line 10)" in summary and "1 longer than --seq 32 (line 14)" in summary
    # a template that raises on a conversation, or renders its beginning unlike the whole: counted too
    tok = chat_tokenizer()
    tok.chat_template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('user first') }}{% endif %}"
                         + TEMPLATE)
    rejected = {"messages": [{"role": "assistant", "content": "a"}]}
    tok2 = chat_tokenizer()
    tok2.chat_template = "{% for m in messages|reverse %}{{ m['content'] }} {% endfor %}"     # newest turn first
    unsplittable = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "the cat"}]}
    assert records.encode_records([(1, rejected)], tok, 32)[1].counts == {"rejected by the chat template": 1}
    assert records.encode_records([(1, unsplittable)], tok2, 32)[1].counts == {"not splittable by the chat template": 1}


# ---- rows: packing, padding, the held-out split, batches -------------------------------------------------

@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_whole_records_with_their_labels_and_padding_masked(tmp_path, pack):
    rows, examples = rows_of(chat_jsonl(tmp_path / "c.jsonl", 20), 32, pack)
    assert rows.input_ids.shape[1] == 32 and sum(rows.records) == len(examples)
    assert (len(rows) < len(examples)) if pack else (len(rows) == len(examples))
    # read the rows back: each row is its records' tokens one after the other, then padding (id 2, -100, mask 0)
    it = iter(examples)
    for r, n in enumerate(rows.records):
        got = [next(it) for _ in range(n)]
        ids = sum((e.ids for e in got), [])
        labels = sum((e.labels for e in got), [])
        k = len(ids)
        assert rows.input_ids[r, :k].tolist() == ids and rows.labels[r, :k].tolist() == labels
        assert (rows.attention_mask[r, :k] == 1).all() and (rows.attention_mask[r, k:] == 0).all()
        assert (rows.input_ids[r, k:] == 2).all() and (rows.labels[r, k:] == IGNORE_INDEX).all()
        if pack and r + 1 < len(rows):     # the next record did not fit in what was left
            assert k + len(examples[sum(rows.records[:r + 1])].ids) > 32
    # our own models take targets: the labels shifted by one, -100 past each row's end (cross_entropy ignores it)
    from pstar_fx.cli.models import model_arg
    idx, tgt = model_arg("tiny").row_inputs(rows)
    assert torch.equal(idx, rows.input_ids) and torch.equal(tgt[:, :-1], rows.labels[:, 1:])
    assert (tgt[:, -1] == IGNORE_INDEX).all()


def test_held_out_is_by_record_and_batches_cover_every_row_each_epoch(tmp_path):
    _, examples = rows_of(chat_jsonl(tmp_path / "c.jsonl", 41), 32)
    train, held = records.held_out_records(examples)
    assert train + held == examples and len(held) == 2          # 5% of 41, whole records, the last ones
    rows = records.pack_rows(train, 32, 2)
    batches = records.row_batches(rows, 4, seed=3)
    epoch = torch.cat([next(batches).input_ids for _ in range(len(rows) // 4)])
    all_rows = {tuple(r) for r in rows.input_ids.tolist()}
    assert len(all_rows) == len(rows)                            # random sentences: no two rows alike
    as_set = {tuple(r) for r in epoch.tolist()}
    assert len(as_set) == len(epoch) and as_set <= all_rows      # an epoch's batches: each row at most once
    again = records.row_batches(rows, 4, seed=3)
    assert torch.equal(next(again).input_ids, epoch[:4])
    # evaluation: every held-out row once, the last batch filled with rows that train nothing
    full = records.eval_batches(records.pack_rows(held, 32, 2), 4, 2)
    assert len(full) == 1 and (full[0].labels[len(records.pack_rows(held, 32, 2)):] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="at least 2"):
        records.held_out_records(examples[:1])


# ---- through the engine: the loss and the training of the eager Hugging Face model with -100 labels ---------

def test_packed_and_padded_batches_train_like_the_eager_hf_model_with_masked_labels(tmp_path):
    from test_hf import eager, matches_eager_with_state_on_host
    from pstar_fx.cli.models import model_arg
    path = chat_jsonl(tmp_path / "c.jsonl", 24)
    spec = model_arg(f"hf:{tiny_llama_dir(tmp_path / 'llama')}")
    assert spec.takes_attention_mask
    # one run, packed and padded batches in turn (both are rows of 32)
    packed = records.row_batches(rows_of(path, 32, pack=True)[0], 3, seed=0)
    padded = records.row_batches(rows_of(path, 32, pack=False)[0], 3, seed=0)
    data = [spec.row_inputs(next(packed if t % 2 == 0 else padded)) for t in range(4)]
    assert set(data[0]) == {"input_ids", "labels", "attention_mask"}
    assert all((b["attention_mask"] == 0).any() and (b["labels"] == IGNORE_INDEX).any() for b in data)
    model = tiny_llama()
    opt = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.1}
    ref, ref_losses = eager(model, data, opt)
    # the eager loss is the mean over the batch's trained tokens, which is what the records' labels say
    with torch.no_grad():
        b = data[0]
        logits = model(**b).logits[:, :-1].flatten(0, 1)
        target = b["labels"][:, 1:].flatten()
        kept = target != IGNORE_INDEX
        by_hand = torch.nn.functional.cross_entropy(logits[kept], target[kept], reduction="sum") / kept.sum()
    assert ref_losses[0] == pytest.approx(by_hand.item(), rel=1e-6)
    matches_eager_with_state_on_host(model, data, ref, ref_losses, chunk_size=2048, opt=opt)


# ---- pstar-fx train --data FILE.jsonl ---------------------------------------------------------------------

def test_train_on_chat_records_evaluates_saves_and_resumes_exactly(tmp_path, capsys):
    from safetensors.torch import load_file
    from test_cli import _metrics, _steps
    from test_engine import rounding_tolerance
    from pstar_fx.cli import main
    hf = tiny_llama_dir(tmp_path / "llama")
    data = chat_jsonl(tmp_path / "chat.jsonl", 40, bad=['{"prompt": "who"}', '{"messages": []}'])
    common = ["train", "--model", f"hf:{hf}", "--data", str(data), "--batch", "2", "--seq", "32", "--lr", "0.01",
              "--device-memory", "512KiB",                        # one compile, not the demo budget search
              "--eval-every", "2", "--log-every", "2"]
    whole = tmp_path / "whole"
    assert main(common + ["--steps", "4", "--save", str(whole), "--metrics", str(tmp_path / "w.jsonl")]) == 0
    out = capsys.readouterr().out
    assert (f"data: 40 records of {data} (tokenizer {hf}, vocab 23); 2 bad records skipped: 1 missing keys (line 41), "
            "1 non-list messages (line 42)") in out
    assert "packed rows of 32 tokens" in out and "held out: 2 records in 1 row(s)" in out
    assert "step     4  loss " in out and "(mean of steps 3-4)" in out
    assert "(step 1) -> " in out and "(mean of steps 3-4)\n" in out.split("done: ")[1]
    ran = _metrics(tmp_path / "w.jsonl")
    assert [r["step"] for r in ran] == [1, 2, 3, 4] and [r["step"] for r in ran if "eval_loss" in r] == [2, 4]
    # the eval loss is the eager model's mean over every trained token of the held-out records (the last 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(whole), dtype=torch.float32).eval()
    tok = chat_tokenizer()
    found, _ = records.read_records(data)
    held = records.pack_rows(records.encode_records(found, tok, 32)[0][-2:], 32, 2)

    def mean_loss(m, dtype):
        with torch.no_grad():
            logits = m.to(dtype)(input_ids=held.input_ids, attention_mask=held.attention_mask).logits
            target = held.labels[:, 1:].flatten()
            return float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), target, reduction="sum")
                         / (target != IGNORE_INDEX).sum())
    eager32 = mean_loss(model, torch.float32)
    truth = mean_loss(model, torch.float64)
    assert ran[-1]["eval_loss"] == pytest.approx(eager32, rel=rounding_tolerance(eager32, truth, 1), abs=0)
    # 2 steps, save; 2 more resumed: the same losses, eval losses and weights as 4 in one go
    half, m = tmp_path / "half", tmp_path / "m.jsonl"
    assert main(common + ["--steps", "2", "--save", str(half), "--metrics", str(m)]) == 0
    assert main(common + ["--steps", "2", "--resume", str(half), "--save", str(half), "--metrics", str(m)]) == 0
    resumed = _metrics(m)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ran]
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in ran]
    assert _steps(capsys.readouterr().out, "eval loss")[4] == round(ran[-1]["eval_loss"], 4)
    a, b = load_file(str(half / "model.safetensors")), load_file(str(whole / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("lines, extra, message", [
    (['{"prompt": "a"}', "oops"], [], "data {p}: no usable record (2 bad records skipped: 1 missing keys (line 1), "
                                      "1 not JSON (line 2))"),
    (['{"prompt": "' + "the " * 40 + '", "completion": "a"}'], [], "1 longer than --seq 32 (line 1)"),
    (['{"prompt": "a", "completion": "b"}'], ["--tokenizer", "bytes"], "JSONL records need a tokenizer"),
    (['{"prompt": "a", "completion": "b"}'], ["--eval-every", "1"], "holding some out for evaluation needs at least 2"),
])
def test_unusable_records_are_a_clear_error_before_compiling(tmp_path, capsys, lines, extra, message):
    from pstar_fx.cli import main
    hf = tiny_llama_dir(tmp_path / "llama")
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    assert main(["train", "--model", f"hf:{hf}", "--data", str(p), "--seq", "32", "--steps", "1", *extra]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("pstar-fx train: error:") and message.format(p=p) in err and "\n" not in err
    assert "parameters;" not in captured.out


def test_no_pack_pads_one_record_a_row_and_pack_is_for_records_only(tmp_path, capsys):
    from pstar_fx.cli import main
    hf = tiny_llama_dir(tmp_path / "llama")
    data = chat_jsonl(tmp_path / "chat.jsonl", 12)
    assert main(["train", "--model", f"hf:{hf}", "--data", str(data), "--seq", "32", "--batch", "2", "--steps", "1",
                 "--no-pack"]) == 0
    assert "rows: 12 padded rows of 32 tokens" in capsys.readouterr().out
    (tmp_path / "t.txt").write_text("the cat sat " * 50)
    assert main(["train", "--model", f"hf:{hf}", "--data", str(tmp_path / "t.txt"), "--seq", "32", "--steps", "1",
                 "--pack"]) == 1
    assert "--pack / --no-pack apply to JSONL records" in capsys.readouterr().err


def test_lora_on_chat_records_evaluates_saves_and_resumes_exactly(tmp_path, capsys):
    """The fine-tuning recipe end to end: an HF model, chat JSONL records, LoRA through peft, a held-out eval, a
    save and a resume: 2 + 2 resumed steps give the losses, eval losses and adapter of 4 in one go, and peft loads
    the adapter."""
    peft = pytest.importorskip("peft", reason="the peft extra (pip install pstar_fx[peft])")
    from safetensors.torch import load_file
    from test_cli import _metrics
    from pstar_fx.cli import main
    hf = tiny_llama_dir(tmp_path / "llama")
    data = chat_jsonl(tmp_path / "chat.jsonl", 40)
    common = ["train", "--model", f"hf:{hf}", "--data", str(data), "--batch", "2", "--seq", "32", "--lr", "0.01",
              "--device-memory", "512KiB", "--eval-every", "2", "--log-every", "2",
              "--lora", "r=4,alpha=8,targets=q_proj,v_proj"]
    whole, half = tmp_path / "whole", tmp_path / "half"
    assert main(common + ["--steps", "4", "--save", str(whole), "--metrics", str(tmp_path / "w.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "LoRA r=4 on q_proj,v_proj" in out and "frozen chunks:" in out and "packed rows of 32 tokens" in out
    assert main(common + ["--steps", "2", "--save", str(half), "--metrics", str(tmp_path / "m.jsonl")]) == 0
    assert main(common + ["--steps", "2", "--resume", str(half), "--save", str(half),
                          "--metrics", str(tmp_path / "m.jsonl")]) == 0
    ran, resumed = _metrics(tmp_path / "w.jsonl"), _metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in ran if "eval_loss" in r] == [2, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in ran]
    assert [r.get("eval_loss") for r in resumed] == [r.get("eval_loss") for r in ran]
    a, b = load_file(str(half / "adapter_model.safetensors")), load_file(str(whole / "adapter_model.safetensors"))
    assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(str(hf)), str(whole))
    assert loaded.peft_config["default"].r == 4
