"""capture_blocks: the captured step of a model with repeated blocks, made from traces of the model cut to a few
of its blocks instead of a trace of all of them.

make_fx spends ~0.4 ms a node (GPT3_18B: 12,298 nodes, 5.2 s on the development VM, 7-10.6 s on the H100 box: the
longest phase of a warm compile). Each block of a stack (an `nn.ModuleList` of modules alike) adds exactly three
contiguous stretches to the step's node sequence — its parameters' placeholders, its forward, its backward
(bench/capture_blocks.py: GPT3_18B, our Llama3_8B and Hugging Face's LlamaForCausalLM). So the step of N blocks is the
4-block step with N - 4 copies of a middle block (block 2) inserted after it, each copy's inputs outside its own
stretches taken as block 2's differ from block 1's: the same node (a value every block reads: rope tables, the
attention mask), the block before's (the hidden state, forward), or the block after's (the gradient, backward).
Nodes are made in the full trace's order with the full trace's names, so the graph, its code and the plan cache's
fingerprint are a full trace's (tests/test_capture_blocks.py holds the code equal, model by model).

It is checked, never assumed: the blocks must be alike (class, parameters' names, shapes, dtypes and trainability,
buffers, non-tensor attributes but an index, no hooks, no parameter shared), the two traces must differ by exactly
three inserted stretches whose neighbours repeat them, each relation must hold for block 2 against block 1, the
same construction from the 3- and 4-block traces must give the 5-block trace node for node, and the last 4 blocks
traced in the first ones' places must give the 4-block trace (a block that runs otherwise by its index: a path for
the last layer, a pattern its attributes do not show). Where block 0 runs otherwise (nothing before the stack is
trained: its backward makes no input gradient), it stays outside the template and each of these is one block on:
blocks 1-4 of a 5-block trace, block 3 against block 2, a 6-block check, the last 5 blocks. Anything else, or a
forward that does not run on a shorter stack, and the whole model is traced as before. GPT3_18B on the development
VM: 5.7 s whole, 2.0 s so (four small traces, 1.2 s of it). Copies share their template's metadata (`val`: shape,
strides, dtype; no pass here compares fake tensors by identity). PSTAR_FX_CAPTURE_BLOCKS=0 traces every block.
"""
from __future__ import annotations

import difflib
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from .config import parse_flag
from .fxutil import node_copy

log = logging.getLogger("pstar_fx")

# the four small traces hold 16 blocks and four times the ends (embedding, head, loss): a whole trace costs as much
# at about 24 blocks (development VM: our tiny LLaMA at 16 blocks 1.5-1.9 s whole, 1.9 so; at 24, 2.3-2.4 and 2.1-2.2;
# at 32, 3.3 and 2.1-2.3); fewer are traced whole
MIN_BLOCKS = 24
TRACED = 4              # blocks in the template: its first and last at the ends, two in the middle
MAX_LEAD = 1            # blocks before the template's that may run otherwise (traced as the model's other nodes)


def wanted() -> bool:
    return parse_flag(os.environ.get("PSTAR_FX_CAPTURE_BLOCKS", "1"), "PSTAR_FX_CAPTURE_BLOCKS")


def by_blocks(fake_model: nn.Module, trace: Callable[[nn.Module], fx.GraphModule]) -> fx.GraphModule | None:
    """The step of `fake_model` (a fake copy, cut and restored here) as `trace` would give it, made from the
    traces of its first 3, 4 and 5 blocks and its last 4 (one more each where block 0 stays outside the template);
    None where it cannot be (then the caller traces it whole)."""
    found = _stack(fake_model)
    if found is None:
        return None
    parent, name, blocks = found
    params = _block_params(fake_model, blocks)
    if params is None:
        return None
    n = len(blocks)

    def cut(chosen: list[int]) -> fx.GraphModule:
        return _cut(fake_model, parent, name, blocks, chosen, trace)

    # Where the first block runs otherwise (nothing before it is trained, so its backward makes no input gradient:
    # peft's LoRA, a frozen embedding), the template is read with block 0 outside it (`lead` 1: blocks 1-4 of a
    # 5-block trace against a 4-block one); else from blocks 0-3. Lead 1 holds wherever lead 0 does (one block more
    # traced), so the likely one is tried first, the other where it does not repeat.
    trained_before = any(p.requires_grad for p in list(fake_model.parameters())[:params[0]])
    leads = range(MAX_LEAD + 1) if trained_before else range(MAX_LEAD, -1, -1)
    try:
        small: dict[int, fx.GraphModule] = {}
        # read from two small traces: where the blocks do not repeat, nothing, before the other traces are paid
        # for; else one block more made from it, to check against its trace below
        for lead in leads:
            for k in (TRACED + lead - 1, TRACED + lead):
                if k not in small:
                    small[k] = cut(list(range(k)))
            template = _template(small[TRACED + lead - 1], small[TRACED + lead], *params, lead)
            check = _build(template, TRACED + lead + 1) if template is not None else None
            if check is not None:
                break
        else:
            log.debug("capture by blocks: the blocks' stretches do not repeat; traced whole")
            return None
        if TRACED + lead + 1 not in small:
            small[TRACED + lead + 1] = cut(list(range(TRACED + lead + 1)))
        # the last blocks traced in the first ones' places: a block whose index changes what it runs (a path taken
        # by the last layer, a pattern every few layers that its attributes do not show) makes another graph
        tail = cut(list(range(n - TRACED - lead, n)))
    except Exception as e:  # noqa: BLE001 - a forward that needs every block: traced whole
        log.debug("capture by blocks: a cut stack does not trace (%s: %s); traced whole", type(e).__name__, e)
        return None
    k = TRACED + lead
    if _text(tail.graph) != _text(small[k].graph):
        log.debug("capture by blocks: the last %d blocks trace otherwise than the first; traced whole", k)
        return None
    if _text(check.graph) != _text(small[k + 1].graph):
        log.debug("capture by blocks: %s blocks made from %s are not their trace; traced whole", k + 1, k)
        return None
    gm = _build(template, n)
    if gm is not None:
        log.info("  captured %d blocks of %s.%s from a trace of %d", n, type(parent).__name__, name, k)
    return gm


def _stack(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList] | None:
    """The longest `nn.ModuleList` of at least MIN_BLOCKS modules alike (`_alike`), with its parent and name."""
    best = None
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) >= max(MIN_BLOCKS, len(best[2]) + 1 if best else 0):
                best = (parent, name, child)
    if best is None or not _alike(list(best[2])):
        return None
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    if any(uses[id(p)] != 1 for b in best[2] for p in b.parameters()):
        return None                     # a block's parameter tied to another module's
    return best


_NOT_ATTRS = {"_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
              "_backward_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks", "_state_dict_pre_hooks",
              "_load_state_dict_post_hooks", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
              "_forward_hooks_always_called", "_non_persistent_buffers_set", "_is_full_backward_hook"}


def _attrs(m: nn.Module) -> dict:
    return {k: v for k, v in vars(m).items() if k not in _NOT_ATTRS}


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or getattr(m, "_forward_hooks_with_kwargs", None))


def _same(a, b, ia: int, ib: int, depth: int = 0) -> bool:
    """Two blocks' attribute values the same (blocks `ia` and `ib`): equal, a name that differs only by the block's
    index in it (peft's `target_name`, "model.layers.5.mlp"), or (containers, modules held as plain attributes:
    Hugging Face's kernel functions) the same parts. A tensor, or anything whose == is not a plain True: not."""
    if a is b:
        return True
    if type(a) is not type(b) or depth > 4:
        return False
    if isinstance(a, str):
        return a == b or (f".{ia}." in a and a.replace(f".{ia}.", ".#.") == b.replace(f".{ib}.", ".#."))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], ia, ib, depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, ia, ib, depth + 1) for x, y in zip(a, b))
    if isinstance(a, nn.Module):
        return (not _hooked(a) and not _hooked(b) and not a._parameters and not b._parameters and not a._buffers
                and not b._buffers and not a._modules and not b._modules
                and _same(_attrs(a), _attrs(b), ia, ib, depth + 1))
    try:
        return (a == b) is True
    except Exception:  # noqa: BLE001 - not comparable: not the same
        return False


def _alike(blocks: list[nn.Module]) -> bool:
    """Same class, module tree, parameters (name, shape, dtype, trainability), buffers (name, shape, dtype), no
    hooks, and the same non-tensor attributes (`_same`), an int attribute that is every block's index (a
    `layer_idx`) aside."""
    first = list(blocks[0].named_modules())
    # (module path, attribute) whose value is the block's index in the first two blocks
    index = {(path, k) for (path, m0), (_, m1) in zip(first, blocks[1].named_modules())
             for k, v in _attrs(m0).items() if type(v) is int and v == 0 and _attrs(m1).get(k) == 1}

    def tensors(m: nn.Module) -> tuple:
        return (tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m._parameters.items()
                      if p is not None),
                tuple((n, tuple(b.shape), b.dtype) for n, b in m._buffers.items() if b is not None))

    for i, block in enumerate(blocks):
        mods = list(block.named_modules())
        if [p for p, _ in mods] != [p for p, _ in first]:
            return False
        for (path, m), (_, m0) in zip(mods, first):
            if type(m) is not type(m0) or _hooked(m) or tensors(m) != tensors(m0):
                return False
            a, a0 = _attrs(m), _attrs(m0)
            if a.keys() != a0.keys():
                return False
            for k, v in a.items():
                if (path, k) in index:
                    if v != i:
                        return False
                elif not _same(v, a0[k], i, 0):
                    return False
    return True


def _block_params(root: nn.Module, blocks: nn.ModuleList) -> tuple[int, int] | None:
    """(index of the stack's first parameter among the model's, parameters a block), where the blocks' parameters
    follow one another block by block (the order the placeholders take); else None."""
    path = next(p for p, m in root.named_modules() if m is blocks)
    names = [n for n, _ in root.named_parameters()]
    per_block = len(list(blocks[0].parameters()))
    first = next((i for i, n in enumerate(names) if n.startswith(f"{path}.0.")), None)
    if first is None or per_block == 0:
        return None
    for i in range(len(blocks)):
        span = names[first + i * per_block: first + (i + 1) * per_block]
        if len(span) != per_block or not all(n.startswith(f"{path}.{i}.") for n in span):
            return None
    return first, per_block


def _cut(root: nn.Module, parent: nn.Module, name: str, blocks: nn.ModuleList, chosen: list[int],
         trace: Callable[[nn.Module], fx.GraphModule]) -> fx.GraphModule:
    """`trace` of `root` with its stack cut to the blocks `chosen` (restored after)."""
    parent._modules[name] = nn.ModuleList(blocks[i] for i in chosen)
    try:
        return trace(root)
    finally:
        parent._modules[name] = blocks


def _key(n: fx.Node) -> tuple:
    """What a node is, for lining two traces up: its op and target (a placeholder's target: its numbered name)."""
    return (n.op,) if n.op == "placeholder" else (n.op, str(n.target))


def _stretches(small: fx.Graph, big: fx.Graph, params_at: int, per_block: int) -> list[tuple[int, int]] | None:
    """(start, length) in `big` of the three stretches one more block inserted: its parameters' placeholders (the
    last block's: `params_at`, `per_block` of them, as the model orders its parameters), its forward and its
    backward (where the two traces' other nodes differ)."""
    a = [_key(n) for n in small.nodes if n.op != "placeholder"]
    ph = sum(1 for n in big.nodes if n.op == "placeholder")
    b = [_key(n) for n in big.nodes if n.op != "placeholder"]
    ops = [op for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if len(ops) != 2 or any(op[0] != "insert" for op in ops):
        return None
    return [(params_at, per_block)] + [(ph + j1, j2 - j1) for _, _, _, j1, j2 in ops]


def _run(keys: list[tuple], start: int, length: int, lead: int) -> tuple[int, int] | None:
    """(first, last) start of the run of equal stretches of `length` through [start, start + length); None where
    it holds fewer than TRACED or more than TRACED + `lead` of them."""
    seg = keys[start: start + length]
    lo, hi = start, start
    while lo - length >= 0 and keys[lo - length: lo] == seg:
        lo -= length
    while keys[hi + length: hi + 2 * length] == seg:
        hi += length
    return (lo, hi) if TRACED <= (hi - lo) // length + 1 <= TRACED + lead else None


@dataclass
class _Template:
    """What `big` (a trace of `lead` + TRACED blocks) says of its last TRACED blocks (the first `lead` are as the
    model's other nodes): its nodes, each block's stretches (`where[b]`: parameters, forward, backward), each block
    node's place (`at`: block, kind, position) and how the template block's (`lead` + 2) nodes read theirs
    (`relation`, `_relations`)."""
    big: fx.GraphModule
    nodes: list[fx.Node]
    where: dict[int, list[list[fx.Node]]]
    at: dict[fx.Node, tuple[int, int, int]]
    relation: dict[fx.Node, list[tuple]]
    output: fx.Node
    lead: int


def _template(small: fx.GraphModule, big: fx.GraphModule, first: int, per_block: int,
              lead: int) -> _Template | None:
    """The blocks of `big` (`lead` + TRACED blocks) against `small` (one fewer), the blocks' parameters from
    placeholder `first` on, `per_block` each; None where the blocks do not repeat as the module docstring says."""
    end = lead + TRACED - 1                     # the last block
    found = _stretches(small.graph, big.graph, first + end * per_block, per_block)
    if found is None:
        return None
    nodes = list(big.graph.nodes)
    keys = [_key(n) for n in nodes]
    (pa, pl), (fa, fl), (ba, bl) = found
    # The blocks alike, where the inserted stretch lies among their stretches is the aligner's choice (often the
    # first, sometimes a rotation: a block's tail and the next one's head). Each kind's stretches are the run of
    # equal ones through it; a rotated run is still a periodic cut of the same graph (the relations below then read
    # the neighbour's parameters too). The template's blocks: the run's last TRACED forward, its first TRACED
    # backward (the last block first), whether the `lead` blocks before repeat them or not. Parameters go by name:
    # the last block's are `pa`.
    fwd, bwd = _run(keys, fa, fl, lead), _run(keys, ba, bl, lead)
    if fwd is None or bwd is None or pa - (TRACED - 1) * pl < 0:
        return None
    where: dict[int, list[list[fx.Node]]] = {}
    for b in range(lead, end + 1):
        back = end - b
        f, w = fwd[1] - back * fl, bwd[0] + back * bl
        where[b] = [nodes[pa - back * pl: pa - back * pl + pl], nodes[f: f + fl], nodes[w: w + bl]]
    for b in range(lead, end):
        if any([_key(n) for n in x] != [_key(n) for n in y] for x, y in zip(where[b], where[end])):
            return None
    at = {n: (b, kind, q) for b, kinds in where.items() for kind, span in enumerate(kinds) for q, n in enumerate(span)}
    relation = _relations(where, at, lead)
    if relation is None:
        return None
    # outside the blocks, only the ends' nodes may be read (the output's gradients aside, handled below)
    output = big.graph.output_node()
    middle = (lead + 1, lead + 2)
    for n in nodes:
        if n not in at and n is not output and any(at.get(a, (-1,))[0] in middle for a in n.all_input_nodes):
            return None
    return _Template(big, nodes, where, at, relation, output, lead)


def _relations(where, at, lead: int) -> dict | None:
    """For each node of the template block (t = `lead` + 2) and each node it reads, how the copy of block j reads
    it: ("self", kind, q) its own, ("prev", kind, q) block j - 1's, ("next", kind, q) block j + 1's, ("shared",
    node) the same node; read from block t against block t - 1. None where they disagree."""
    t = lead + 2
    relation = {}
    for kind, (tspan, rspan) in enumerate(zip(where[t], where[t - 1])):
        for q, (n, r) in enumerate(zip(tspan, rspan)):
            na, ra = n.all_input_nodes, r.all_input_nodes
            if len(na) != len(ra) or _shape(n) != _shape(r):
                return None
            how = []
            for a, b in zip(na, ra):
                pa, pb = at.get(a), at.get(b)
                if pa is None and pb is None and a is b:
                    how.append(("shared", a))
                elif pa and pb and pa[0] == t and pb[0] == t - 1 and pa[1:] == pb[1:]:
                    how.append(("self", *pa[1:]))
                elif pa and pb and pa[0] == t - 1 and pb[0] == t - 2 and pa[1:] == pb[1:]:
                    how.append(("prev", *pa[1:]))
                elif pa and pb and pa[0] == t + 1 and pb[0] == t and pa[1:] == pb[1:]:
                    how.append(("next", *pa[1:]))
                else:
                    return None
            relation[n] = how
    return relation


def _shape(n: fx.Node):
    """A node's arguments with every node in them replaced by a marker: what must match between two blocks."""
    return repr(fx.map_arg((n.args, n.kwargs), lambda _: "%"))


def _build(template: _Template, n_blocks: int) -> fx.GraphModule | None:
    """The step of `n_blocks` blocks, in the full trace's order: the template's last block (`end`) becomes block
    n - 1, copies end .. n - 2 of its block t (`lead` + 2) go between (parameters and forward after block t's,
    backward after block n - 1's, the last first); None where a copy would read a node not made yet."""
    big, nodes, where, at, relation, output = (template.big, template.nodes, template.where, template.at,
                                               template.relation, template.output)
    t, end = template.lead + 2, template.lead + TRACED - 1
    g = fx.Graph()
    made: dict[tuple[int, int, int], fx.Node] = {}      # (block, kind, q) -> node of the new graph
    env: dict[fx.Node, fx.Node] = {}                    # node of `big` outside the blocks -> new node
    last = n_blocks - 1
    traced_block = {b: b for b in where}
    traced_block[end] = last

    def block_node(b: int, kind: int, q: int) -> fx.Node:
        node = made.get((b, kind, q))
        if node is None:
            raise _NotYet
        return node

    def arg_of_traced(a: fx.Node, reader_block: int | None) -> fx.Node:
        p = at.get(a)
        if p is None:
            return env[a]
        b, kind, q = p
        new_b = traced_block[b]
        # the traced neighbours now have copies between them
        if reader_block == end and b == t:
            new_b = last - 1
        elif reader_block == t and b == end:
            new_b = end if last > end else last
        return block_node(new_b, kind, q)

    def emit(template: fx.Node, args_map) -> fx.Node:
        # named as the template, or the next free name of its kind: in the full trace's order, the full trace's
        # names (fxutil.node_copy: torch 2.11's create_name would walk every taken number of a kind each time)
        new = node_copy(g, template, args_map)
        if new.op == "placeholder":
            new.target = new.name           # (a placeholder's target is its argument's name)
        return new

    def emit_copy(j: int, kind: int, q: int) -> None:
        n = where[t][kind][q]
        mapping = {}
        for a, r in zip(n.all_input_nodes, relation[n]):
            if r[0] == "shared":
                mapping[a] = arg_of_traced(r[1], None)
            else:
                b = {"self": j, "prev": j - 1, "next": j + 1}[r[0]]
                mapping[a] = block_node(min(b, last), r[1], r[2])       # (block n - 1: the traced last block)
        made[(j, kind, q)] = emit(n, lambda a: mapping[a])

    try:
        for n in nodes:
            if n is output:
                break
            p = at.get(n)
            if p is None:
                env[n] = emit(n, lambda a: arg_of_traced(a, None))
                continue
            b, kind, q = p
            made[(traced_block[b], kind, q)] = emit(n, lambda a, b=b: arg_of_traced(a, b))
            span = where[b][kind]
            if q == len(span) - 1 and (b, kind) in ((t, 0), (t, 1)):         # after block t's params, forward
                for j in range(end, last):
                    for qq in range(len(span)):
                        emit_copy(j, kind, qq)
            if q == len(span) - 1 and (b, kind) == (end, 2):                # after block n - 1's backward
                for j in range(last - 1, t, -1):
                    for qq in range(len(span)):
                        emit_copy(j, kind, qq)
    except (_NotYet, KeyError):
        return None
    outs = list(output.args[0])
    grads_t = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and at.get(o, (None,))[0] == t]
    grads_end = [i for i, o in enumerate(outs) if isinstance(o, fx.Node) and at.get(o, (None,))[0] == end]
    if len(grads_t) != len(grads_end) or not grads_t or grads_t != list(range(grads_t[0], grads_t[0] + len(grads_t))) \
            or grads_end != list(range(grads_t[-1] + 1, grads_t[-1] + 1 + len(grads_end))):
        return None
    new_outs = []
    for i, o in enumerate(outs):
        new_outs.append(arg_of_traced(o, None) if isinstance(o, fx.Node) and at.get(o) is None
                        else (block_node(traced_block[at[o][0]], *at[o][1:]) if isinstance(o, fx.Node) else o))
        if i == grads_t[-1]:
            for j in range(end, last):
                new_outs.extend(block_node(j, *at[outs[k]][1:]) for k in grads_t)
    g.output(new_outs)
    g.output_node().meta = dict(output.meta)
    g._codegen = fx.graph.CodeGen()      # (positional, as capture._normalize makes it: the trace's spec counts 4)
    with _use_lazy_graph_module(True):          # (its code is made when first read: capture._normalize changes it)
        return _make_graph_module(big, g)


class _NotYet(Exception):
    """A copy reads a node not made yet: the blocks do not run in the order assumed."""


def _text(g: fx.Graph) -> list[tuple]:
    """A graph node for node: op, name, target, arguments (nodes by name), and its value's shape and dtype."""
    out = []
    for n in g.nodes:
        val = n.meta.get("val")
        out.append((n.op, n.name, str(n.target), repr(fx.map_arg((n.args, n.kwargs), lambda a: a.name)),
                    tuple(getattr(val, "shape", ())), str(getattr(val, "dtype", ""))))
    return out
