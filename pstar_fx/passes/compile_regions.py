"""compile_regions: the compute between chunk nodes, compiled by Inductor.

Needs: the lowered graph (after insert_chunk_ops) and its Plan. Provides: each run of ATen compute ops
between two chunk nodes that order memory or streams becomes one call of a `Region`, a function
torch.compile (Inductor) builds from those ops, so norms, activations, residual adds, bias gradients and
casts fuse into fewer kernels; matmuls and attention stay the library kernels they were.

What may move, and why it is safe:
  - `rt.param(i)` (a view of a resident chunk) and constants move up to the start of their run: the chunk
    was fetched before the run began, since `rt.fetch` ends a run.
  - `rt.grad(i, g)`, `rt.grad_mm(i, a, b)` and `rt.release(c)` move down to its end: a gradient slot is only
    read by the chunk's update, and a compute slot may be handed out again only after the last op that reads
    it, which is now the region.
  - `rt.prefetch(c)` moves up, unless a release moved down before it in the same run (the prefetch
    takes the slot that release gives back): then the run is cut there.
Everything else stays in place and ends a run: `rt.fetch` (the compute stream waits for a copy),
updates, offloads and collectives, seeded random ops (they reseed through rt), and in-place ops. Where the plan
is by block (planning/blocks.py: it put the chunk moves and updates between blocks), a run also ends where a
block's span begins, so every block's forward is one region, and its backward another, the same function for
every block (a plan op by op keeps its runs: cut at blocks too, they make more distinct functions, not fewer).

Memory: a region frees what it read only when it returns (the caller holds its inputs), and a gradient
moved down lives to the region's end. The plan's activation profile is recomputed with those lifetimes
(the region's own intermediates counted as its ops make them one by one), and a region that would push the
plan over its budget is left eager. `Plan.notes` says what this changed. Compiled code may hold more at once
than the ops one by one (Inductor's code for a 70B LoRA's MLP backward held 3.5 GiB more): each region keeps
the memory the plan leaves at its fullest call (`Region.spare_bytes`), and `build_regions` measures the
compiled region against its ops on CUDA; one that needs more than that runs op by op (`Region.eager_because`).

Regions with the same ops on the same shapes (every transformer block's) share one compiled function.
"""
from __future__ import annotations

import logging
import math
import operator
import os
import pickle
import time

import torch
import torch.fx as fx

from ..config import format_bytes
from .. import planning as plan_mod
from ..planning.blocks import SPAN
from ..planning.transaction import kept_along, kept_here
from ..fxutil import aliases_input, args_by_position, mutated_args, node_copy, role_nodes
from . import region_builders
from .region_builders import inductor_cache_dir
from .contract import CHUNK_OPS, PLANNED, REGIONS, Pass, PassContext

NAME = "compile_regions"
log = logging.getLogger("pstar_fx")


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """The regions, with the PlanDelta of what holding them costs in gm.meta["plan_delta"] (the runner folds it)."""
    return compile_regions(gm, ctx.plan, cuda=ctx.device.type == "cuda")


PASS = Pass(NAME, run, requires=frozenset({CHUNK_OPS, PLANNED}), provides=frozenset({REGIONS}), optional=True,
            only_if="compiles_compute", why="the compute between chunk nodes fuses into fewer kernels (Inductor)")

BACKEND = "inductor"   # torch.compile's backend for the regions; tests use "eager" (Dynamo alone: the same ops)

# library kernels Inductor calls as they are: a run of only these (and views) gains nothing from compiling
_EXTERN = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default, torch.ops.aten.embedding.default}
_MOVE_UP = {"param", "prefetch"}
_MOVE_DOWN = {"grad", "grad_mm", "release"}


class Region:
    """One compiled function of a region's ops. Called like the ops it replaces: tensors in, a tuple out.
    `build_regions` compiles every one ahead of the first step."""

    def __init__(self, gm: fx.GraphModule, name: str, backend: str, specs: list, key: str = ""):
        self.graph_module = gm              # the region's ops, readable: region.graph_module.code
        self.__name__ = self.__qualname__ = name
        self._specs = specs
        self.backend, self.key = backend, key   # key: equal for equal regions (ops and input layouts)
        # Dynamo's build (`torch.compile` of the region's pickled copy), made at its first use: a region that runs
        # its standalone artifact never needs it (the pickling and the wrapper: ~0.9 s for an 18B's 24 regions)
        self._compiled = None
        self.eager_because: str | None = None   # why it runs op by op after all (Dynamo refused it, or memory)
        # the device memory the plan leaves free at its fullest call (None: no budget): what compiling may add
        # to its ops' own (`build_regions` measures that)
        self.spare_bytes: int | None = None
        self._artifact = None               # a standalone Inductor artifact run instead of Dynamo's (artifacts_on)
        self._artifact_ran = False          # whether it has returned once (a later failure is the step's own)
        self._artifact_path: str | None = None  # where it was saved (a failure at its first call is noted beside)

    def __call__(self, *args):
        with torch.no_grad():               # one grad mode, whoever calls: the compiled guards never differ
            if self.eager_because is not None:
                return self.graph_module(*args)
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.Unsupported as e:
                # Dynamo refused to compile it, before anything ran: its ops run as they are (same values, slower)
                _op_by_op(self, (str(e).strip().splitlines() or [type(e).__name__])[0],
                          trace=torch._dynamo.config.verbose)     # TORCHDYNAMO_VERBOSE=1: where it failed
                return self.graph_module(*args)

    def compiled(self, *args):
        """The compiled function called, an error inside it raised as itself: a failure in the compiled code (CUDA
        out of memory) reached torch 2.11's GraphModule, which walks its traceback with a generator, which Dynamo,
        still watching, refused ("Attempt to trace generator"), hiding the error that happened."""
        if self._artifact is not None:
            try:
                out = self._artifact(*args)
            except AssertionError as e:     # its code checks every input's size and strides before it runs
                log.warning("%s: its Inductor artifact was built for other input layouts (%s); Dynamo compiles "
                            "it now", self.__name__, str(e).splitlines()[0] if str(e) else "size or stride")
                self._artifact = None
            except torch.OutOfMemoryError:
                raise
            except Exception as e:
                if self._artifact_ran:
                    raise
                # its first call (the build's, on zeros) failed inside Inductor's own wrappers: torch 2.11 on the
                # H200 raised IndexError in `copy_misaligned_inputs` for GPT3_18B's regions, which the CPU (no
                # alignment checks) never shows. Dynamo's build of the same region is the default path
                repeated = len(args) - len({id(a) for a in args})   # (what to look at next: Dynamo dedupes)
                log.warning("%s: its Inductor artifact failed at its first call (%s: %s; %d inputs, %d of them a "
                            "tensor passed before); Dynamo compiles it now", self.__name__, type(e).__name__, e,
                            len(args), repeated, exc_info=True)
                self._artifact = None
                if self._artifact_path is not None:     # the next build goes to Dynamo at once
                    region_builders.mark_artifact_failed(self._artifact_path, f"{type(e).__name__}: {e}")
            else:
                self._artifact_ran = True
                return out
        if self._compiled is None:
            self._compiled = torch.compile(_as_a_worker_has_it(self.graph_module), backend=self.backend,
                                           fullgraph=True, dynamic=False)
        try:
            return self._compiled(*args)
        except torch._dynamo.exc.Unsupported as e:
            if e.__context__ is not None and not isinstance(e.__context__, torch._dynamo.exc.TorchDynamoException):
                raise e.__context__ from None
            raise

    def __repr__(self):
        return f"<Region {self.__name__}: {region_builders.n_ops(self.graph_module)} ops>"


def _as_a_worker_has_it(gm: fx.GraphModule) -> fx.GraphModule:
    """The region as a build worker receives it (region_builders.py): its pickled copy. Pickling drops the nodes'
    meta, which AOTAutograd's cache key reads, so this process and the workers hit the same cache entries
    (compiling `gm` itself, this process missed what a worker had saved and traced the region again). A region
    that does not pickle is compiled as it is (the workers could not build it either)."""
    try:
        return pickle.loads(pickle.dumps(gm))
    except (pickle.PicklingError, TypeError, AttributeError):
        return gm


def _distinct(gm: fx.GraphModule) -> list["Region"]:
    return list(dict.fromkeys(n.target for n in gm.graph.nodes if isinstance(n.target, Region)))


def _buildable(gm: fx.GraphModule) -> list["Region"]:
    """`gm`'s distinct regions whose every input's layout is known: those a worker can build ahead."""
    return [r for r in _distinct(gm) if all(s is not None for s in r._specs)]


def start_region_builders(gm: fx.GraphModule, device: torch.device,
                          standby: region_builders.Standby | None = None) -> region_builders.Builders | None:
    """On a cold cache, worker processes start building `gm`'s regions (region_builders.py); None when none
    start. `build_regions(gm, device, builders)` loads each region once its worker has built it. `standby`: workers
    started ahead (region_builders.Standby), used instead of new ones, sent away if none are needed."""
    inductor_cache_dir()
    known = _buildable(gm)
    if not known:
        if standby is not None:
            standby.close()
        return None
    return region_builders.start([(r.key, r.graph_module, r._specs) for r in known], device, known[0].backend,
                                 standby)


def regions_marker(gm: fx.GraphModule, device: torch.device) -> str | None:
    """The file that says `gm`'s regions were built on this machine (region_builders' marker), None without any."""
    known = _buildable(gm)
    return region_builders.marker([r.key for r in known], device, known[0].backend) if known else None


def build_regions(gm: fx.GraphModule, device: torch.device,
                  builders: region_builders.Builders | None | bool = True) -> int:
    """Compile every distinct region of `gm` now, in the order the step calls them, on zero-filled inputs laid
    out like the step's; returns how many were built (one with an input of unknown shape compiles at its first
    call). Inductor's autotuning then allocates (benchmark copies, a buffer the size of the L2 cache to flush
    it) beside the chunk memory but before any activation exists, instead of on top of the plan's peak in the
    first step (the engine allocates the chunks first, so that their host memory is page-locked meanwhile).

    An input another region returns is laid out as that region's build returned it, not as its fake value
    says: a library kernel inside a region may return something else than its fake. Flash and memory-efficient
    attention return their RNG seed and offset as CPU tensors (their fakes: CUDA ones), and a stand-in on the
    wrong device, or with other strides, would make the step recompile what was built.

    Inductor's caches fill and load under `region_builders.inductor_cache_dir()`; on a cold cache, worker processes
    build the regions side by side (region_builders.py), and this process loads each as soon as its worker has
    built it (until then, the ones before it in the step).
    `builders`: those workers, started by `start_region_builders` (None: none were; True, the default: start
    them here)."""
    inductor_cache_dir()
    if builders is True:
        builders = start_region_builders(gm, device)
    if builders is not None:
        _import_inductor()          # while the workers build the first regions (this process would only wait)
    try:
        built = _build_in_order(gm, device, builders)
    except BaseException:
        if builders is not None:
            builders.stop()             # nothing marked built
        raise
    if builders is not None:
        builders.wait()                 # (done by now: this process waited for each region; marks them built)
    return built


def _import_inductor() -> None:
    """Inductor's modules that loading the first region imports (the first region took this process 3.1-3.8 s to
    load on the H100 box, later ones ~0.3 s), imported while the build workers are busy."""
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import CompiledArtifact  # noqa: F401


def _build_in_order(gm: fx.GraphModule, device: torch.device, builders: region_builders.Builders | None) -> int:
    made: dict[fx.Node, _Layout] = {}              # a region's output (its getitem node) -> its layout as built
    # a region's output -> (the call, the first of its outputs that is the same tensor): a compiled region returns
    # one tensor for outputs that alias (a value and its detach), and a consumer handed it twice is compiled for
    # duplicate inputs (Dynamo guards on them); built with two stand-ins instead, it compiled again at the first
    # step (HF Llama: 5 of its regions, ~20 s at 8B on the H200)
    same: dict[fx.Node, tuple[fx.Node, int]] = {}
    outputs: dict[Region, tuple[list[_Layout | None], list[int]] | None] = {}
    spent: list[tuple[str, float, float]] = []     # per region: seconds waiting for its worker, then here
    for node in gm.graph.nodes:
        region = node.target
        if not isinstance(region, Region):
            continue
        if region not in outputs:
            specs = [("value", made[a], None) if a in made else spec for a, spec in zip(node.args, region._specs)]
            if any(s is None for s in specs):
                outputs[region] = None
                continue
            artifact = region_builders.artifacts_on() and region.backend == "inductor"
            examples, stand_ins = [], {}    # one stand-in per tensor the step will pass: aliased outputs share one
            distinct = []                   # an artifact's build: each repeat a stand-in of its own
            for a, spec in zip(node.args, specs):
                key = same.get(a, a)
                repeat = key in stand_ins
                if not repeat:
                    stand_ins[key] = _example(spec, device)
                examples.append(stand_ins[key])
                distinct.append(_example(spec, device) if repeat and artifact else stand_ins[key])
            t0 = time.perf_counter()
            if builders is not None:        # loaded as soon as its worker has built it, while they build others
                builders.wait_for(region.key)
                builders.make_room(region.key)
            t1 = time.perf_counter()
            try:
                if artifact:
                    # built on distinct inputs: AOTAutograd dedupes a repeated one, and torch 2.11's artifact of
                    # a deduped graph indexed past its inputs at the call (IndexError on the H200, likely this);
                    # a graph that writes no input computes the same on one tensor passed twice
                    _use_artifact(region, specs, distinct, device)
                    distinct.clear()
                outs = region(*examples)
            except Exception as e:          # compiling or running it ran out, with no activation held yet
                if not _ran_out_of_memory(e):
                    raise
                outs = _after_out_of_memory(region, examples, builders)
            firsts = [next(j for j, other in enumerate(outs) if other is o) if isinstance(o, torch.Tensor) else i
                      for i, o in enumerate(outs)]
            outputs[region] = ([_Layout.of(o) if isinstance(o, torch.Tensor) else None for o in outs], firsts)
            del outs
            if region.spare_bytes is not None and region.eager_because is None:
                _fits_compiled(region, specs, examples, device)
            del examples, stand_ins, distinct
            spent.append((region.__name__, t1 - t0, time.perf_counter() - t1))
        if outputs[region] is not None:
            layouts, firsts = outputs[region]
            for user in node.users:
                if user.target is operator.getitem:
                    if layouts[user.args[1]] is not None:
                        made[user] = layouts[user.args[1]]
                    same[user] = (node, firsts[user.args[1]])
    if spent:
        waited, own = sum(w for _, w, _ in spent), sum(b for _, _, b in spent)
        name, _, longest = max(spent, key=lambda t: t[2])
        log.info("  build regions: %d here, %.1f s waiting for their workers, %.1f s building or loading (the longest: "
                 "%s, %.1f s)", len(spent), waited, own, name, longest)
    return sum(v is not None for v in outputs.values())


def _use_artifact(region: Region, specs: list, examples: list, device: torch.device) -> None:
    """The region's standalone Inductor artifact for inputs laid out as `specs`, loaded from the cache folder (a
    build worker or an earlier compile saved it), else built here and saved: its calls then skip Dynamo
    (region_builders.artifacts_on)."""
    path = region_builders.artifact_path(region.key, specs, device)
    if region_builders.artifact_failed(path):
        return                          # it failed at a first call before: Dynamo's build (region.compiled)
    region._artifact_path = path
    if os.path.exists(path):
        try:
            region._artifact = region_builders.load_artifact(path)
            return
        except Exception as e:          # an unreadable file is rebuilt, never trusted
            log.warning("%s: its saved Inductor artifact could not be loaded (%s: %s); building it again",
                        region.__name__, type(e).__name__, e)
    region._artifact = region_builders.save_artifact(region.graph_module, examples, path)


def _fits_compiled(region: Region, specs: list, examples: list, device: torch.device) -> None:
    """The plan counts a region's intermediates as its ops make them one by one; Inductor's code may hold more at
    once (a 70B LoRA's MLP backward allocated a 16384 x 28672 buffer for two of them), which the plan's spare
    memory at the region's fullest call may not cover (that first step ran out of memory). Measured here on the
    build's inputs, compiled against op by op, once: the figure is kept beside Inductor's caches for the next
    build of the same region (region_builders.recorded_extra); a region that needs more than that spare runs op
    by op."""
    spare, cuda = max(region.spare_bytes, 0), device.type == "cuda"
    extra = region_builders.recorded_extra(region.key, specs, device) if cuda else None
    if extra is None:
        try:
            extra = _extra_bytes(region, examples, device)
        except torch.OutOfMemoryError:
            _out_of_memory_at_build(region)
            return
        if cuda and extra is not None:
            region_builders.record_extra(region.key, specs, device, extra)
    if extra is None or extra <= spare:
        return
    _op_by_op(region, f"compiled, it holds {format_bytes(extra)} more device memory than its ops one by one, and "
                      f"the plan leaves {format_bytes(spare)} at its fullest call")


def _after_out_of_memory(region: Region, examples: list, builders: region_builders.Builders | None) -> tuple:
    """The region's build outputs after its first try ran out of device memory: tried again compiled once the build
    workers have given their shares of the device memory back (while they were still running), else op by op."""
    if builders is not None and builders.running():
        builders.wait()
        torch.cuda.empty_cache()
        try:
            return region(*examples)
        except Exception as e:
            if not _ran_out_of_memory(e):
                raise
    _out_of_memory_at_build(region)
    return region(*examples)        # op by op now (what the plan counted)


def _ran_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the device running out of memory, raised as itself or wrapped: Inductor raises an
    InductorError whose cause is the OutOfMemoryError of its autotuning's benchmark buffers (a GPT3_10B region built
    here on an H100 while the build workers held 7 GiB of it, session 38: the compile failed)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or getattr(e, "inner_exception", None)    # (InductorError keeps it there)
    return False


def _out_of_memory_at_build(region: Region) -> None:
    """With no activation held yet, the step's call would surely run out too."""
    torch.cuda.empty_cache()
    _op_by_op(region, "compiled, it ran out of device memory at its build, with no activation held yet")


def _op_by_op(region: Region, why: str, trace: bool = False) -> None:
    """`region` runs its ops as they are from now on, said once (with the error being handled, where `trace`)."""
    region.eager_because = why
    log.warning("%s (%d ops) runs op by op: %s", region.__name__, region_builders.n_ops(region.graph_module), why,
                exc_info=trace)


def _extra_bytes(region: Region, examples: list, device: torch.device) -> int | None:
    """Device bytes the compiled region holds beyond its ops run one by one: at its peak, or in what it returns
    (an output that is a view of a larger buffer holds all of it). The compiled function is built already. None
    off CUDA (no allocator statistics: the CPU tier's budget is the plan's count)."""
    if device.type != "cuda":
        return None
    def use(fn) -> tuple[int, int]:
        torch.cuda.empty_cache()        # the build's other allocations (autotuning) returned, not fragmenting
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            outs = fn(*examples)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - base
        top = torch.cuda.max_memory_allocated(device) - base
        del outs
        return top, held
    compiled, eager = use(region.compiled), use(region.graph_module)
    return max(0, compiled[0] - eager[0], compiled[1] - eager[1])


class _Layout:
    """How a tensor lies: enough to make zeros laid out the same way (a fake value, or a real tensor's)."""
    __slots__ = ("shape", "stride", "storage_offset", "storage_elems", "dtype", "device")

    def __init__(self, shape, stride, storage_offset, storage_elems, dtype, device):
        self.shape, self.stride, self.storage_offset = shape, stride, storage_offset
        self.storage_elems, self.dtype, self.device = storage_elems, dtype, device

    @staticmethod
    def of(t: torch.Tensor) -> "_Layout":
        return _Layout(tuple(t.shape), t.stride(), t.storage_offset(),
                       max(1, t.untyped_storage().nbytes() // t.element_size()), t.dtype, t.device)


def _is_compute(node: fx.Node) -> bool:
    if node.op != "call_function" or hasattr(node.target, "seeded_op") or mutated_args(node):
        return False
    return isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem


def _kernels(nodes: list[fx.Node]) -> int:
    """Ops of a run Inductor would generate code for (not views, not library kernels)."""
    return sum(1 for n in nodes if n.op == "call_function" and n.target not in _EXTERN and not aliases_input(n))


def find_runs(g: fx.Graph, by_block: bool = False) -> list[tuple[list[fx.Node], list[fx.Node], list[fx.Node]]]:
    """(moved up, compute, moved down) for each run of compute between two nodes that end a run; `by_block`: and
    where a block's span begins (the plan put the chunk moves and updates there). An op with several outputs and
    the getitems taking them apart stay in one run (`_getitems_after_their_ops`): a run returning such an op whole
    fails its build (AOTAutograd: "output spec mismatch"; GPT3_10B by block on an H100 box, session 32, where a
    span's cut fell between the final layer norm's outputs)."""
    _getitems_after_their_ops(g)
    runs = []
    up: list[fx.Node] = []
    ops: list[fx.Node] = []
    down: list[fx.Node] = []

    def close():
        nonlocal up, ops, down
        if ops:
            runs.append((up, ops, down))
        up, ops, down = [], [], []

    ups_before_last = 0                     # of `up`, the nodes before the run's last op
    for node in g.nodes:
        inside = set(ops)
        if by_block and _is_compute(node) and ops and node.meta.get(SPAN) != ops[-1].meta.get(SPAN) and not (
                node.target is operator.getitem and node.args[0] in inside):
            # a block's span begins (planning/blocks.py): its own region, with the parameter views made for it
            ahead = up[ups_before_last:]
            up = up[:ups_before_last]
            close()
            up, inside = ahead, set()
        if _is_compute(node) and (node.target is not operator.getitem or node.args[0] in inside):
            ops.append(node)
            ups_before_last = len(up)
        elif node.op == "call_method" and node.target in _MOVE_UP and not any(
                d.target == "release" for d in down):
            up.append(node)
        elif node.op == "call_method" and node.target == "prefetch":   # after a moved release: cut here
            close()
            up.append(node)
        elif node.op == "call_method" and node.target in _MOVE_DOWN:
            down.append(node)
        elif node.op == "get_attr" or (node.op == "call_function" and node.target is operator.getitem):
            up.append(node)                 # a constant, or one output of an op before the run
        else:
            close()
    close()
    return runs


def _getitems_after_their_ops(g: fx.Graph) -> None:
    """Each getitem moved next to the op whose output it takes (they read nothing else): a chunk node the schedule
    put between them would end a run there."""
    for node in list(g.nodes):
        if (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node)
                and node.args[0].op == "call_function"):
            at = node.args[0]
            while at.next.op == "call_function" and at.next.target is operator.getitem and at.next.args[0] is \
                    node.args[0] and at.next is not node:
                at = at.next
            if at.next is not node:
                at.append(node)


def _region_io(ops: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    inside = set(ops)
    inputs: list[fx.Node] = []
    for n in ops:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in ops if any(u not in inside for u in n.users)]
    return inputs, outputs


def _shared_outputs(runs: list[list[fx.Node]], spare: dict[int, int | None], structure: dict[int, str],
                    io: dict[int, tuple[list[fx.Node], list[fx.Node]]]) -> dict[int, list[int]]:
    """Where runs of the same ops on the same inputs return different values, what each of them returns instead (by
    id of its ops: the positions in them): every value any of them needs outside. The last block's forward returns
    one value fewer than the others (nothing reads its residual stream in 16 bits), and a function of its own would
    cost a cold compile another build; returning that value anyway costs the call its bytes until it returns, where
    its spare memory (`spare`; None: no budget) has room (else the run keeps its own outputs). `structure`, `io`:
    each run's `_structure` and `_region_io`, by id of its ops."""
    groups: dict[str, list[list[fx.Node]]] = {}
    for ops in runs:
        groups.setdefault(structure[id(ops)], []).append(ops)
    returned = {}
    for group in groups.values():
        wanted = sorted({ops.index(o) for ops in group for o in io[id(ops)][1]})
        for ops in group:
            more = [ops[i] for i in wanted if ops[i] not in io[id(ops)][1]]
            room = spare.get(id(ops))
            if more and (room is None or room >= sum(map(_bytes, more))):
                returned[id(ops)] = wanted
    return returned


def _structure(ops: list[fx.Node], inputs: list[fx.Node]) -> str:
    """A run's ops and its inputs' layouts, as a string equal for equal runs: each op with its arguments, a value
    as the position of the input or op making it, a tensor constant as itself (capture lifts them into constants:
    none expected). Taken from the run's own nodes, without the graph `_extract` builds (~14 000 node copies at
    18B, where 17 of 248 runs are functions of their own)."""
    at = {a: i for i, a in enumerate(inputs)}
    at.update({n: len(inputs) + i for i, n in enumerate(ops)})
    metas = [(v.shape, tuple(v.stride), str(v.dtype)) if (v := spec and spec[1]) is not None else None
             for spec in map(_spec, inputs)]
    return repr([(n.op, _name(n.target), fx.node.map_aggregate(args_by_position(n, at), _tensor_literal))
                 for n in ops]) + repr(metas)


def _key(ops: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node], structure: str | None = None) -> str:
    """A region's key: equal for equal regions (the same ops, constants and input layouts, returning the same
    values), the compiled function they share. `structure`: the run's `_structure`, where taken already (the same
    after the runs before it became region calls: an input's position and layout are kept)."""
    at = {n: i for i, n in enumerate(ops)}
    return (structure or _structure(ops, inputs)) + repr([at[o] for o in outputs])


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _spec(a: fx.Node):
    """What an input of a region is: a parameter view (its fake value's layout, its offset in the chunk), a value
    (its fake value's layout), None (unknown)."""
    if a.op == "call_method" and a.target == "param" and "param" in a.meta:
        val, offset = a.meta["param"]
        return ("param", _Layout.of(val), offset) if isinstance(val, torch.Tensor) else None
    val = a.meta.get("val")
    return ("value", _Layout.of(val), None) if isinstance(val, torch.Tensor) else None


def _example(spec, device: torch.device) -> torch.Tensor:
    """Zeros laid out like the step's input: the same shape, strides, storage offset (so alignment) and dtype.
    Zeros, because an index read by an op (embedding, a loss's targets) must be in range."""
    kind, val, offset = spec
    if kind == "param":           # a contiguous view at `offset` elements into a chunk's compute slot
        base = torch.zeros(offset % 64 + math.prod(val.shape), dtype=val.dtype, device=device)
        return base[offset % 64:].view(val.shape)
    where = val.device if val.device.type == "cpu" else device   # a value the step keeps on the CPU stays there
    return torch.zeros(val.storage_elems, dtype=val.dtype, device=where).as_strided(val.shape, val.stride,
                                                                                    val.storage_offset)


def _extract(ops: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.Graph:
    """The region as its own graph with canonical names (inputs `in0`..., values `v0`...), made only for a region
    whose key (`_key`) no region before it has: most repeat one (every transformer block's)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = g.placeholder(f"in{i}")
        env[a].meta["val"] = a.meta.get("val")
    for i, n in enumerate(ops):
        env[n] = node_copy(g, n, env.__getitem__, name=f"v{i}")
    g.output(tuple(env[o] for o in outputs))
    return g


def _tensor_literal(a):
    """A tensor in an op's arguments (capture lifts them into constants: none expected) stands for itself only."""
    return f"tensor@{id(a)}" if isinstance(a, torch.Tensor) else a


def _name(target) -> str:
    """What a node's target is called in a key: an op's name with its overload, a function's module and name (an
    object without one: its repr, which holds its address: never equal to another's)."""
    if isinstance(target, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(target)
    qualname = getattr(target, "__qualname__", None)
    return f"{target.__module__}.{qualname}" if qualname and hasattr(target, "__module__") else repr(target)


def _module(g: fx.Graph) -> fx.GraphModule:
    return fx.GraphModule(torch.nn.Module(), g)


def _order(g: fx.Graph, runs: list) -> list[fx.Node]:
    """The graph's nodes in the order they run once `runs` are moved (moved-up nodes, ops, moved-down)."""
    first = {ops[0]: up for up, ops, _ in runs}
    last = {ops[-1]: down for _, ops, down in runs}
    moved = {n for up, _, down in runs for n in (*up, *down)}
    order = []
    for n in g.nodes:
        if n in moved:
            continue
        order += first.get(n, [])
        order.append(n)
        order += last.get(n, [])
    return order


def _frees(order: list[fx.Node], compiled: list) -> dict[fx.Node, list[fx.Node]]:
    """Last uses along `order`, with each compiled region's inputs freed only when it returns."""
    frees = plan_mod.last_uses(order)
    for _, ops, _ in compiled:
        inside = set(ops)
        for n in ops[:-1]:
            held = [v for v in frees.get(n, []) if v not in inside]
            if held:
                frees[n] = [v for v in frees[n] if v in inside]
                frees.setdefault(ops[-1], []).extend(held)
    return frees


def _profile(g: fx.Graph, runs: list, compiled: list, cuda: bool, plan) -> tuple[list[fx.Node], list[int], int]:
    """The nodes in the order the regions run them, the live bytes after each, their peak: the graph's values and the
    gradients kept in backward's freed memory (`_kept_along`)."""
    order = _order(g, runs)
    skip = set(role_nodes(g, "rt")) | set(role_nodes(g, "buffer"))
    per_node, peak = plan_mod.activation_profile(g, skip, round_to=plan_mod.CUDA_BLOCK_BYTES if cuda else 1,
                                                 cuda=cuda, order=order, frees=_frees(order, compiled))
    kept = _kept_along(order, plan)
    if kept:
        per_node = [a + b for a, b in zip(per_node, kept)]
        peak = max(peak, max(per_node, default=0))
    return order, per_node, peak


def _kept_along(order: list[fx.Node], plan) -> list[int] | None:
    """Bytes of the device chunks' gradients kept in the memory backward frees (`plan.kept_in_activations`) after
    each node of `order`: each from its chunk's update on (planning.transaction.kept_along)."""
    if not plan.kept_in_activations:
        return None
    updates = {n: n.args[1] for n in order if n.op == "call_method" and n.target == "adam"}
    kept = set(kept_here([c for c in updates.values() if plan.placement[c] == "device"], plan.kept_on_device))
    at = [i for i, n in enumerate(order) if updates.get(n) in kept]
    return kept_along(len(order), at, plan.memory.grad_chunk_bytes)


def compile_regions(gm: fx.GraphModule, plan, *, cuda: bool, backend: str | None = None,
                    min_kernels: int = 2) -> fx.GraphModule:
    """Compile `gm`'s runs of compute in place. What holding the regions' inputs costs goes to the planner as
    `gm.meta["plan_delta"]` (planning.fold counts it); runs that would take the plan over its budget stay eager.
    A run with fewer than `min_kernels` ops Inductor would generate (a lone matmul between two chunk nodes) stays
    eager too. Equal runs share one compiled function (`_key`), returning what any of them needs
    (`_shared_outputs`)."""
    backend = backend or BACKEND
    g = gm.graph
    runs = [r for r in find_runs(g, plan.moves.by_block) if _kernels(r[1]) >= min_kernels]
    _, _, eager_peak = _profile(g, [], [], cuda, plan)
    budget = plan_mod.usable_budget(plan.budget_bytes, cuda)
    # (the device peak less what the profile counts: the graph's values, and the gradients kept among them)
    in_profile = plan.activation_peak_bytes + (plan.device_breakdown.get("kept gradients", 0)
                                               if plan.kept_in_activations else 0)
    limit = None if budget is None else budget - (plan.device_peak_bytes - in_profile)
    chosen = list(runs)
    left_eager = 0
    while True:
        order, per_node, peak = _profile(g, chosen, chosen, cuda, plan)
        if limit is None or peak <= max(limit, eager_peak) or not chosen:
            break
        # over the budget: the region whose span holds the peak runs eager (its nodes stay where they were)
        at = order[max(range(len(per_node)), key=per_node.__getitem__)]
        pos = {n: i for i, n in enumerate(order)}
        hit = [r for r in chosen if pos[(r[0] or r[1])[0]] <= pos[at] <= pos[(r[2] or r[1])[-1]]]
        worst = hit[0] if hit else max(chosen, key=lambda r: len(r[1]))
        chosen.remove(worst)
        left_eager += 1

    pos = {n: i for i, n in enumerate(order)}
    spare = {id(ops): None if limit is None else
             limit - max(per_node[pos[(up or ops)[0]]:pos[(down or ops)[-1]] + 1]) for up, ops, down in chosen}
    _reorder(g, chosen)
    regions: dict[str, Region] = {}
    io = {id(ops): _region_io(ops) for _, ops, _ in chosen}
    structure = {id(ops): _structure(ops, io[id(ops)][0]) for _, ops, _ in chosen}
    returned = _shared_outputs([ops for _, ops, _ in chosen], spare, structure, io)
    for up, ops, down in chosen:
        inputs, outputs = _region_io(ops)
        if id(ops) in returned:
            outputs = [ops[i] for i in returned[id(ops)]]
        key = _key(ops, inputs, outputs, structure[id(ops)])
        if key not in regions:
            regions[key] = Region(_module(_extract(ops, inputs, outputs)), f"region_{len(regions)}", backend,
                                  [_spec(a) for a in inputs], key)
        if spare[id(ops)] is not None:
            left = regions[key].spare_bytes
            regions[key].spare_bytes = spare[id(ops)] if left is None else min(left, spare[id(ops)])
        with g.inserting_before(ops[0]):
            call = g.call_function(regions[key], tuple(inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        anchor = call
        named = []
        for i, o in enumerate(outputs):
            if not any(u not in ops for u in o.users):
                continue                # returned for another call of the function: nothing here reads it
            with g.inserting_after(anchor):
                out = anchor = g.call_function(operator.getitem, (call, i))
            out.meta["val"] = o.meta.get("val")
            o.replace_all_uses_with(out)
            named.append((out, o.name))
        for n in reversed(ops):
            g.erase_node(n)
        for out, name in named:          # the graph reads as before: each value keeps its name
            out._rename(name)
    g.lint()
    gm.recompile()

    delta = max(0, peak - eager_peak)
    n_ops = sum(len(ops) for _, ops, _ in chosen)
    # what the plan must count now: the planner folds it in (planning.fold); a pass never writes the Plan
    gm.meta["plan_delta"] = plan_mod.PlanDelta(activation_bytes=delta, notes=(
        f"compute: {len(chosen)} regions of {n_ops} ops compiled by {backend} ({len(regions)} distinct functions)"
        + (f", {left_eager} left eager to stay in the budget" if left_eager else "")
        + f"; holding the regions' inputs to their ends: activation peak +{format_bytes(delta)}",))
    gm.meta["regions"] = list(regions.values())
    return gm


def _reorder(g: fx.Graph, runs: list) -> None:
    for up, ops, down in runs:
        for n in up:
            ops[0].prepend(n)
        tail = ops[-1]
        for n in down:
            tail.append(n)
            tail = n
