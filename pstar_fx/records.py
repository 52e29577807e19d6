"""records: instruction and chat data — JSONL records to fixed-length token rows with a loss mask.

A record is one JSON object a line (blank lines are skipped):
    {"prompt": "...", "completion": "..."}       the prompt's tokens (with the tokenizer's special tokens, a
                                                 BOS if it adds one), then the completion's and the EOS token;
                                                 trained on the completion and the EOS only.
    {"messages": [{"role": ..., "content": ...}, ...]}
                                                 rendered with the tokenizer's chat template
                                                 (`apply_chat_template`); trained on the assistant turns only.
Labels follow Hugging Face's convention: unshifted, -100 (`IGNORE_INDEX`) where nothing is trained, so a causal
LM given `labels=` shifts them itself and its loss is the mean over the unmasked tokens of the batch.

An assistant turn's tokens are found by rendering prefixes of the conversation: messages[:i] with the
generation prompt ends where turn i's content starts, messages[:i + 1] ends after its end-of-turn marker
(both must be prefixes of the whole rendering). Each masked or trained piece of text is tokenized on its own
and the pieces concatenated, so the mask is exact for any tokenizer (no character offsets needed).

Records become rows of exactly `seq` tokens: packed (`pack_rows`: whole records, in order, as many as fit in a
row; attention is not cut between records of one row, as in most packing trainers) or padded (`pad_rows`: one
record a row). Padding is the pad token (the EOS if the tokenizer has none), label -100, attention mask 0.
`held_out_records` keeps the last 5% of records (at least one) for evaluation, before any row is made, so no
record is split between training and evaluation. A record that cannot be used (not JSON, missing keys, a
non-string, an empty completion, longer than `seq`) is counted by kind and skipped (`Problems.summary`).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

IGNORE_INDEX = -100                 # Hugging Face's (and torch cross_entropy's default) "not trained" label
HELD_OUT_FRACTION = 0.05
RECORD_SUFFIXES = (".jsonl",)       # a --data file with this suffix holds records, not text


@dataclass(frozen=True)
class Example:
    """One record as tokens: `labels[i]` is `ids[i]` where that token is trained, IGNORE_INDEX elsewhere."""
    ids: list[int]
    labels: list[int]
    line: int                        # where it came from in the file (1-based), for messages about it


@dataclass
class Problems:
    """Records skipped, by kind, with the first line of each kind."""
    counts: Counter = field(default_factory=Counter)
    first_line: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, line: int) -> None:
        """Count one record of this kind, at this line."""
        self.counts[kind] += 1
        self.first_line.setdefault(kind, line)

    def total(self) -> int:
        """Records skipped, all kinds."""
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line: '3 bad records skipped: 2 missing keys (first at line 4), 1 not JSON (line 9)'."""
        if not self.counts:
            return "no bad records"
        parts = [f"{n} {kind} (first at line {self.first_line[kind]})" if n > 1
                 else f"1 {kind} (line {self.first_line[kind]})" for kind, n in self.counts.most_common()]
        return f"{self.total()} bad record{'s' if self.total() > 1 else ''} skipped: " + ", ".join(parts)


def is_records(path: str | os.PathLike | None) -> bool:
    """Whether a --data path is a file of JSONL records."""
    return path is not None and Path(path).suffix in RECORD_SUFFIXES and not Path(path).is_dir()


def check_record(obj) -> str | None:
    """What is wrong with a parsed record (a short kind, the same words `Problems` counts), or None."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            return "non-list messages"
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return "missing keys"
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                return "non-string"
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if not replies or not all(replies):
            return "empty completion"          # nothing to train on, or an assistant turn with nothing in it
        return None
    if "prompt" not in obj or "completion" not in obj:
        return "missing keys"
    if not isinstance(obj["prompt"], str) or not isinstance(obj["completion"], str):
        return "non-string"
    if not obj["completion"]:
        return "empty completion"
    return None


def read_records(path: str | os.PathLike) -> tuple[list[tuple[int, dict]], Problems]:
    """The usable records of a JSONL file as (line number, record), and the problems of the others."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data: {path} does not exist")
    records, problems = [], Problems()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                problems.add("not UTF-8", line_no)
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                problems.add("not JSON", line_no)
                continue
            kind = check_record(obj)
            if kind:
                problems.add(kind, line_no)
            else:
                records.append((line_no, obj))
    return records, problems


def _pieces(tokenizer, texts_trained: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    ids, labels = [], []
    for text, trained in texts_trained:
        if not text:
            continue
        piece = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE_INDEX] * len(piece)
    return ids, labels


class TemplateError(ValueError):
    """A conversation the chat template rejects (a template may raise, e.g. on roles that do not alternate), or
    whose prefixes it renders as something other than the start of the whole; `kind` is what Problems counts."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def encode_record(record: dict, tokenizer) -> tuple[list[int], list[int]]:
    """(ids, labels) of one checked record (`check_record`); labels are -100 on prompt / non-assistant tokens."""
    if "messages" not in record:
        eos = tokenizer.eos_token_id
        if eos is None:
            raise ValueError("prompt/completion records need a tokenizer with an EOS token (it ends each completion)")
        prompt = tokenizer(record["prompt"], verbose=False)["input_ids"]     # a BOS first, if the tokenizer adds one
        completion = tokenizer(record["completion"], add_special_tokens=False, verbose=False)["input_ids"]
        return prompt + completion + [eos], [IGNORE_INDEX] * len(prompt) + completion + [eos]
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat records (messages) need a tokenizer with a chat template (tokenizer_config.json's "
                         "chat_template); this tokenizer has none")
    messages = record["messages"]

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except Exception as e:        # jinja's errors and the template's own raise_exception(...) alike
            raise TemplateError("rejected by the chat template", f"the chat template rejects it: {e}") from None
    whole = render(len(messages), False)
    cuts, at = [], 0                                # (start, end) of each assistant turn in `whole`
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = len(render(i, True)), len(render(i + 1, False))
        if not (whole.startswith(render(i, True)) and whole.startswith(render(i + 1, False)) and at <= start < end):
            raise TemplateError("not splittable by the chat template", "the chat template does not render a conversation's beginning as the beginning "
                                "of the whole conversation, so its assistant turns cannot be found")
        cuts.append((start, end))
        at = end
    pieces, at = [], 0
    for start, end in cuts:
        pieces += [(whole[at:start], False), (whole[start:end], True)]
        at = end
    pieces.append((whole[at:], False))
    return _pieces(tokenizer, pieces)


def encode_records(records: list[tuple[int, dict]], tokenizer, seq: int,
                   problems: Problems | None = None) -> tuple[list[Example], Problems]:
    """Each record as an Example; one longer than `seq` tokens, or that the template cannot split, is a
    problem (added to `problems`, or a new Problems)."""
    problems = problems if problems is not None else Problems()
    out = []
    for line, record in records:
        try:
            ids, labels = encode_record(record, tokenizer)
        except TemplateError as e:
            problems.add(e.kind, line)
            continue
        if len(ids) > seq:
            problems.add(f"longer than --seq {seq}", line)
            continue
        out.append(Example(ids, labels, line))
    return out, problems


def held_out_records(examples: list, fraction: float = HELD_OUT_FRACTION) -> tuple[list, list]:
    """(train, held-out): the last `fraction` of the records (at least one), kept apart whole."""
    if len(examples) < 2:
        raise ValueError(f"{len(examples)} usable record(s): holding some out for evaluation needs at least 2")
    n = max(1, int(len(examples) * fraction))
    return examples[:-n], examples[-n:]


@dataclass(frozen=True)
class Rows:
    """Fixed-length rows, each (R, seq) int64: `input_ids`, `labels` (-100 where not trained) and
    `attention_mask` (1 on the records' tokens, 0 on padding); `records` per row."""
    input_ids: torch.Tensor
    labels: torch.Tensor
    attention_mask: torch.Tensor
    records: list[int]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def trained(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def _rows(groups: list[list[Example]], seq: int, pad_id: int) -> Rows:
    n = len(groups)
    ids = torch.full((n, seq), pad_id, dtype=torch.int64)
    labels = torch.full((n, seq), IGNORE_INDEX, dtype=torch.int64)
    mask = torch.zeros((n, seq), dtype=torch.int64)
    for r, group in enumerate(groups):
        at = 0
        for e in group:
            k = len(e.ids)
            ids[r, at:at + k] = torch.tensor(e.ids)
            labels[r, at:at + k] = torch.tensor(e.labels)
            mask[r, at:at + k] = 1
            at += k
    return Rows(ids, labels, mask, [len(g) for g in groups])


def _check_lengths(examples: list[Example], seq: int) -> None:
    if not examples:
        raise ValueError("no records to make rows of")
    longest = max(examples, key=lambda e: len(e.ids))
    if len(longest.ids) > seq:
        raise ValueError(f"the record at line {longest.line} is {len(longest.ids)} tokens, longer than a row "
                         f"of {seq}")


def pack_rows(examples: list[Example], seq: int, pad_id: int) -> Rows:
    """Rows of `seq` tokens holding whole records in their order, a new row when the next does not fit; the
    rest of a row is padding. A row's loss (Hugging Face's, over the batch) is the mean over all its records'
    trained tokens: records of one row are not weighted apart."""
    _check_lengths(examples, seq)
    groups, room = [], 0
    for e in examples:
        if len(e.ids) > room:
            groups.append([])
            room = seq
        groups[-1].append(e)
        room -= len(e.ids)
    return _rows(groups, seq, pad_id)


def pad_rows(examples: list[Example], seq: int, pad_id: int) -> Rows:
    """One record a row, padded to `seq` tokens."""
    _check_lengths(examples, seq)
    return _rows([[e] for e in examples], seq, pad_id)


def pad_id(tokenizer) -> int:
    """The token that fills a row's padding: the pad token, else the EOS, else 0 (never trained, masked)."""
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if t is not None:
            return int(t)
    return 0


def row_batches(rows: Rows, batch: int, seed: int = 0) -> Iterator[Rows]:
    """Endless batches of `batch` rows: every row once an epoch, in an order drawn from a seeded generator
    (same seed, same batches); an epoch's last rows go on into the next epoch's batch."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        raise ValueError(f"batch: expected a positive int, got {batch!r}")
    if not len(rows):
        raise ValueError("no rows to draw batches from")
    gen = torch.Generator().manual_seed(seed)
    queue = torch.empty(0, dtype=torch.int64)
    while True:
        while len(queue) < batch:
            queue = torch.cat([queue, torch.randperm(len(rows), generator=gen)])
        take, queue = queue[:batch], queue[batch:]
        yield take_rows(rows, take)


def take_rows(rows: Rows, which) -> Rows:
    """The rows at `which` (indices or a slice), as tensors of their own."""
    idx = torch.as_tensor(which) if not isinstance(which, slice) else which
    counts = [rows.records[i] for i in (range(len(rows))[which] if isinstance(which, slice) else idx.tolist())]
    return Rows(rows.input_ids[idx].clone(), rows.labels[idx].clone(), rows.attention_mask[idx].clone(), counts)


def eval_batches(rows: Rows, batch: int, pad: int) -> list[Rows]:
    """All the held-out rows in batches of `batch`, the last one filled up with rows of padding that carry no
    trained token (their attention mask is 1, so that no query row attends to nothing)."""
    out = []
    for start in range(0, len(rows), batch):
        part = take_rows(rows, slice(start, start + batch))
        short = batch - len(part)
        if short:
            seq = rows.input_ids.shape[1]
            part = Rows(torch.cat([part.input_ids, torch.full((short, seq), pad, dtype=torch.int64)]),
                        torch.cat([part.labels, torch.full((short, seq), IGNORE_INDEX, dtype=torch.int64)]),
                        torch.cat([part.attention_mask, torch.ones((short, seq), dtype=torch.int64)]),
                        part.records + [0] * short)
        out.append(part)
    return out
