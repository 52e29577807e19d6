"""blocks: the step's nodes in spans, one per block of the model, so that chunk moves and updates fall between
blocks and every block's compiled region is the same function.

A model built of repeated blocks (a transformer's layers, `transformer.h.0`, `.h.1`, ... in a ModuleList) runs
the same ops in each. Chunk boundaries fall anywhere in a block, and each `rt.fetch`, `rt.adam` and release ends
a compiled region (passes/compile_regions.py): planned op by op, the cuts fall at a different op in each block
and Inductor builds a function for every variant. The 4.2B GPT on an H100 box: 18 distinct region functions for
95 calls, 22 s of a cold compile's 31.5 s building them; by block 7 for 74, 15 s (bench/RESULTS.md, session 29).
Planned by span (planner.py `_by_span`), every chunk an op of a span reads is resident from the span's first node
to its last (`widen`), each chunk's update waits for the end of the span of its last use (`updates_at_ends`;
insert_chunk_ops moves it there), and the regions are cut at span starts too (compile_regions): one function for
the blocks' forward and one for their backward, as a compiled model's own repeated layers. `fuse_optimizer`
marks the spans (`mark_spans`) where the compute is compiled.

A parameter's block is its name up to its first index (`transformer.h.12.attn.c_attn.weight` ->
`transformer.h.12`); a parameter outside any indexed container (embeddings, the last norm, the head) belongs to
none. A span starts at the first node of backward, at a node reading a block's parameters where that block was not
yet read in this half of the step (forward or backward), and at a node reading only parameters of no block after
a block's span. A node reading parameters of a block already passed (backward's recompute reads the block
before) stays in the current span: the spans of each half follow the blocks in order, never back. A block's span
is then cut where it differs from the ops repeated blocks run at an end (`_cut_to_the_pattern`: the first block's
backward before the embeddings' gradients, the view each block's backward ends with), so that the first and the
last block's regions are every block's functions too.

What it costs: a chunk is resident a little longer (from its block's start, to its block's end), which the
planner sees (the reads it plans from are widened) and counts, in memory (a span's chunks take compute slots at
once: spans whose chunks are more than `limit` stay planned op by op) and in time (a copy has less compute to
hide behind: the schedule's exposed seconds). The planner also plans op by op and keeps that plan where it is
faster (planner.py `SPANS_MAY_COST`, `SPAN_COPY_WAITS`). PSTAR_FX_BLOCK_SPANS=0 plans op by op everywhere.
"""
from __future__ import annotations

import collections
import difflib
import os
import re

import torch.fx as fx

from ..config import parse_flag
from ..fxutil import aliases_input

SPAN = "span"        # node.meta key: the span a node of the fused graph belongs to (an int, increasing)

_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


def enabled() -> bool:
    """PSTAR_FX_BLOCK_SPANS (default 1; 0: chunk moves planned op by op, for an A/B of what spans cost a step)."""
    return parse_flag(os.environ.get("PSTAR_FX_BLOCK_SPANS", "1"), "PSTAR_FX_BLOCK_SPANS")


def block_of(name: str) -> str | None:
    """The block a parameter belongs to: its name up to its first index, None outside any indexed container."""
    m = _INDEX.search(name)
    return name[:m.start(1) + len(m.group(1))] if m else None


def mark_spans(g: fx.Graph, params: list[fx.Node], names: list[str], backward: set[fx.Node]) -> int:
    """Write each node's span into `node.meta[SPAN]` (`params[i]` is the parameter named `names[i]`); the number
    of spans. Graphs with no block (no indexed parameter) get none marked: nothing to align."""
    blocks = {p: block_of(name) for p, name in zip(params, names)}
    if not any(b is not None for b in blocks.values()):
        return 0
    via: dict[fx.Node, set] = {p: {b} for p, b in blocks.items()}     # the blocks a node reads, through views
    span, current, seen, half = -1, None, set(), None
    halves: list[tuple[bool, str | None]] = []       # each span's half (backward: True) and block
    for node in g.nodes:
        if node.op in ("placeholder", "output"):
            continue
        read = set().union(*(via[a] for a in node.all_input_nodes if a in via))
        if read and aliases_input(node):
            via[node] = read
        starts = (node in backward) != half                 # the first node, or backward's
        if starts:
            half, seen = node in backward, set()
        new = sorted(b for b in read if b is not None and b not in seen)
        key = new[0] if new else None if read == {None} else current
        if starts or key != current:
            span += 1
        current = key
        seen.update(b for b in read if b is not None)
        node.meta[SPAN] = span
        if len(halves) <= span:                         # a span begins
            halves.append((half, current))
    return _cut_to_the_pattern(g, halves)


def _cut_to_the_pattern(g: fx.Graph, spans: list[tuple[bool, str | None]]) -> int:
    """The blocks' spans of each half cut where they differ from the ops most of them run (the pattern) at an end,
    so that the ops they share are a span, and a compiled region, alike in every block; the number of spans after.
    Ops reading no parameter stay in the span they fall in, so in backward each block's span ends with the view
    the next block's first matmul reads, and the first block's with the embeddings' gradients instead. Each span
    run once is matched against the patterns, the spans run by two blocks or more (difflib: the longest run of
    equal ops), and where that run is at least 3/4 of a pattern both are cut at its ends: every block's backward
    then runs the ops the first block's does before the embeddings' gradients. Spans differing inside (a block
    whose forward is recomputed runs those ops amid its backward's, each before its first use) are left as they
    are, a pattern of their own where two blocks or more recompute: cut at every difference, the 4.2B's backward
    became 10 functions and 3x the calls."""
    nodes: list[list[fx.Node]] = [[] for _ in spans]
    for node in g.nodes:
        if SPAN in node.meta:
            nodes[node.meta[SPAN]].append(node)
    cuts: dict[int, set[int]] = {}
    for half in (False, True):
        ours = [s for s, (h, key) in enumerate(spans) if h == half and key is not None]
        seqs = {s: tuple((n.op, n.target) for n in nodes[s]) for s in ours}
        counts = collections.Counter(seqs.values())
        patterns = [q for q, n in counts.items() if n >= 2]         # the ops repeated blocks run
        matched: dict[tuple, tuple[tuple, object]] = {}
        in_pattern: dict[tuple, set[int]] = {q: set() for q in patterns}
        for q in set(seqs.values()) - set(patterns):
            found = [(difflib.SequenceMatcher(None, q, p, autojunk=False).find_longest_match(), p) for p in patterns]
            m, p = max(found, key=lambda f: f[0].size, default=(None, None))
            if m is not None and 4 * m.size >= 3 * len(p):
                matched[q] = p, m
                in_pattern[p] |= {m.b, m.b + m.size} - {0, len(p)}
        for s, q in seqs.items():
            if q in in_pattern:
                cuts[s] = in_pattern[q]
            elif q in matched:
                p, m = matched[q]
                at = {m.a, m.a + m.size} | {m.a + c - m.b for c in in_pattern[p] if m.b < c < m.b + m.size}
                cuts[s] = at - {0, len(q)}
    span = -1
    for s, ns in enumerate(nodes):
        span += 1
        for i, n in enumerate(ns):
            span += i in cuts.get(s, ())
            n.meta[SPAN] = span
    return span + 1


def bounds(spans: list[int | None]) -> dict[int, tuple[int, int]]:
    """Each span's first and last node (positions in the list `spans` gives a span for, None: none)."""
    out: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        if s is not None:
            out.setdefault(s, [i, i])[1] = i
    return {s: (a, b) for s, (a, b) in out.items()}


def widen(reads: list[set[int]], spans: list[int | None], limit: int) -> tuple[list[set[int]], set[int]]:
    """`reads` (the chunks each node reads) with each span's chunks read at its first and its last node, so the
    schedule holds them resident across the span, and the spans so widened; a span reading more than `limit`
    chunks is left as it was (its chunks' moves fall inside it anyway)."""
    out = [set(r) for r in reads]
    widened = set()
    for s, (first, last) in bounds(spans).items():
        union = set().union(*reads[first:last + 1])
        if union and len(union) <= limit:
            out[first] |= union
            out[last] |= union
            widened.add(s)
    return out, widened


def updates_at_ends(adam_at: dict[int, int], spans: list[int | None], widened: set[int]) -> dict[int, int]:
    """Each chunk's update moved to the end of the span it follows (the span of the nearest node before it that
    has one), where that span is widened: the position of the node it then goes after."""
    ends = {s: last for s, (_, last) in bounds(spans).items()}
    moved = {}
    for c, i in adam_at.items():
        k = i - 1
        while k >= 0 and spans[k] is None:
            k -= 1
        if k >= 0 and spans[k] in widened and ends[spans[k]] > i:
            moved[c] = ends[spans[k]]
    return moved
