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
