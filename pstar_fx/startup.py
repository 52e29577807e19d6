"""startup: what `compile()` does around and after the plan to make the step ready, side by side.

The chunk memory is allocated as soon as the plan step has made a plan that fits (one rank: `Startup.allocate` is
Lowered's `on_planned`; data parallelism sets its group up first and allocates after lowering). Then what is slow
runs side by side: lowering and the regions pass in this process, the host part's zeroing and page-locking on
threads (~100 GiB at 18B; begun during the search for the buffers the plan surely needs, and before the capture for
all of a compile before this one's: runtime/host_memory.py HostReserve, pipeline/reserve_cache.py), the initial
weights written on a thread of their own (into the masters at once where none is a buffer being locked, else once
the masters' own locks are done, the rest locking beside them; the 16-bit copies once all are ready; the
interpreter hands it the GIL within 0.2 ms meanwhile: parallel_init.prompt_handoffs), on a cold cache the region
builds in worker processes (Inductor; started on standby before the capture where this compile likely builds cold
and no GPU rates are being measured: `standby_builders`), and this process's own building or loading of the regions.
The init draws from generators of its own (parallel_init.own_generators): Dynamo saves and restores the global ones
around each build, which would cut into its draws; after the init the global ones are moved where a serial init
leaves them.
The builds find the device chunks allocated: their examples and autotuning take room the step's activations leave
free until the first step.

`Startup` is a context manager: on an error it never leaves a thread writing chunk memory or a build worker
running, and it always closes the reserve.
"""
from __future__ import annotations

import contextlib
import logging
import os
from concurrent import futures

import torch
import torch.fx as fx
from torch import nn

from .config import Config, format_bytes
from .passes import compile_regions, region_builders
from .passes.compile_regions import build_regions, start_region_builders
from .phases import Phases
from .pipeline import reserve_cache
from .pipeline.lower import Lowered
from .planning import Plan
from .planning.costs import needs_calibration
from .runtime import ChunkRuntime
from .runtime.dist import DataParallel
from .runtime.host_memory import HostReserve, device_threads, pin_threads
from .runtime.parallel_init import own_generators, prompt_handoffs, settle
from .runtime.store import host_buffer_sizes
from .runtime.weights import materialize

log = logging.getLogger("pstar_fx")


def host_reserve(config: Config) -> HostReserve | None:
    """Where host buffers are page-locked (CUDA) by threads: a reserve to make those the plan surely needs early."""
    if config.device.startswith("cuda") and pin_threads() >= 2:
        return HostReserve(pin_threads(), torch.device(config.device))
    return None


def build_regions_now(graph: fx.GraphModule, device: torch.device, phases: Phases, builders=True) -> None:
    """The graph's compute regions compiled (Inductor) now, where their inputs' layouts are known; `builders`:
    worker processes already building them (`start_region_builders`), None for none, True to start them here."""
    regions = graph.meta.get("regions", [])
    if regions:
        with phases("build regions", f"{len(regions)} compiled functions for the compute (Inductor), before "
                                     "the first step"):
            built = build_regions(graph, device, builders)
            if built < len(regions):
                log.info("%d of %d regions compile at their first call (an input's layout is unknown)",
                         len(regions) - built, len(regions))
            if device.type == "cuda":
                torch.cuda.empty_cache()    # what autotuning allocated goes back before the activations need it


def standby_builders(config: Config, compile_key: str) -> region_builders.Standby | None:
    """Region build workers started now, before the capture, where this compile will likely build its regions on a
    cold cache: compiled compute, workers on, and no compile of the same model, inputs and config built them here
    before (region_builders.Standby, probably_built). Not where this compile measures the GPU's rates first: that
    measurement times the host Adam on every core (the rates serve every later plan on the machine), so workers
    importing beside it would skew it, and waiting for its end made them ready later than workers started after
    the regions pass (H100 box, cold 4.2B, session 28)."""
    if not config.compiles_compute or compile_regions.BACKEND != "inductor" or not region_builders.standby_on():
        return None
    workers = region_builders.standby_workers()
    if (workers < 2 or region_builders.probably_built(compile_key)
            or needs_calibration(torch.device(config.device), config.torch_dtype)):
        return None
    return region_builders.Standby(workers)


class Startup:
    """One compile()'s chunk memory, initial weights and region builds (the module docstring)."""

    def __init__(self, model: nn.Module, config: Config, example_inputs):
        self.model, self.config = model, config
        self.phases = Phases()
        self.named = dict(model.named_parameters(remove_duplicate=False))
        self.meta = any(p.is_meta for p in self.named.values())   # (read now: the init makes them master views)
        self._generators = own_generators(config.seed, torch.device(config.device))
        self.rt: ChunkRuntime | None = None
        self._weights: futures.Future | None = None
        self._builders = None
        self._threads = contextlib.ExitStack()
        self.reserve = host_reserve(config)
        self._remembered_at = self._remembered = None
        self.build_times: list[dict] = []
        device = torch.device(config.device)
        self._compile_key = reserve_cache.key(model, example_inputs, config, device)
        self._standby = standby_builders(config, self._compile_key)
        if self.reserve is not None:
            # a compile of this model, inputs and config before this one: the buffers it made, started now
            self._remembered_at = self._compile_key
            self._remembered = reserve_cache.load(self._remembered_at)
            if self._remembered is not None:
                for lock in (True, False):
                    self.reserve.want({n: c for (n, locked), c in self._remembered.sizes.items()
                                       if locked == lock}, lock)

    @property
    def hint(self):
        """Lowered's `host_hint` (None without a reserve): the search's early word on the host buffers."""
        if self.reserve is None:
            return None
        reserve, config = self.reserve, self.config
        return lambda plan, layout: reserve.want(host_buffer_sizes(layout, plan, config, config.torch_dtype))

    def __enter__(self) -> Startup:
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            if kind is not None:
                if self._weights is not None:
                    futures.wait([self._weights])       # never left writing chunk memory
                if self._builders is not None:
                    self._builders.stop()
                if self.rt is not None:
                    self.rt.store.ready()
        finally:
            if self.reserve is not None:
                self.reserve.close()
            if self._standby is not None:
                self._standby.close()               # (none left waiting: those handed shares are the builders')
            self._threads.close()

    def allocate(self, plan: Plan, lowered: Lowered, dp: DataParallel | None = None) -> None:
        """The chunk memory for `plan`, and the initial weights started on their own thread. Called by the pipeline
        once the plan is made (a plan the regions pass may yet add activation bytes to: what is allocated stays
        the same), or by `finish`."""
        remembered, reserve = self._remembered, self.reserve
        if remembered is not None and remembered.plan != reserve_cache.plan_digest(plan):
            log.info("  the host buffers made ahead were another plan's: freed")
            reserve.close()
        chunk_bytes = plan.device_peak_bytes - plan.activation_peak_bytes
        with self.phases("allocate", f"chunk memory: {format_bytes(chunk_bytes)} on {lowered.device.type}, "
                                     f"{format_bytes(plan.host_peak_bytes)} on the host"):
            self.rt = ChunkRuntime(lowered.layout, plan, self.config, lowered.device, lowered.dtype, dp,
                                   ready_later=True, reserve=reserve)
        if reserve is not None:
            reserve.close()                 # (what the store did not take is freed)
        if self._remembered_at is not None:
            reserve_cache.store(self._remembered_at, plan, self.rt.store.host_asked)
        # (entered first, so restored last: the init's thread has ended by then)
        self._threads.enter_context(prompt_handoffs())
        thread = self._threads.enter_context(device_threads(1, lowered.device, "pstar_fx-weights"))
        self._weights = thread.submit(self._write_weights, lowered)

    def finish(self, lowered: Lowered, dp: DataParallel | None) -> ChunkRuntime:
        """The runtime, its weights written and the regions built (allocated here if the pipeline did not)."""
        if self.rt is None:
            self.allocate(lowered.plan, lowered, dp)
        standby, self._standby = self._standby, None
        self._builders = start_region_builders(lowered.graph, lowered.device, standby)   # None: no worker started
        # the step's Python code (a lazy GraphModule's, ~0.4 s at 18B; else made at the first step)
        getattr(lowered.graph, "real_recompile", lambda: None)()
        build_regions_now(lowered.graph, lowered.device, self.phases, builders=self._builders)
        # each region a worker built: its worker, ops, and when (seconds from the workers' start; Builders.times)
        self.build_times = list(self._builders.times) if self._builders is not None else []
        marker = compile_regions.regions_marker(lowered.graph, lowered.device)
        if marker is not None and os.path.exists(marker):
            region_builders.remember_built(self._compile_key, marker)      # the next compile starts no standby
        self._weights.result()
        if self.meta:
            settle(self.config.seed, self._generators)     # the global generators where a serial init leaves them
        return self.rt

    def _locked(self) -> None:
        store = self.rt.store
        if store.pinning:
            with self.phases("page-lock", "the rest of the host chunk memory's page-locking, which ran beside the "
                                          "region builds"):
                store.ready("page-lock")
        store.ready()                   # (closes the allocation batch even where nothing was queued)

    def _write_weights(self, lowered: Lowered) -> None:
        # the masters are written while the page-locking goes on: those being locked (a master that crosses as it
        # is) once their own lock is done, not the rest (GPT3_18B with bf16 moments on the H200 box: 8.9 s of
        # page-locking, then 6.4 s of init, one after the other); the 16-bit copies, which cross, once it is done
        store = self.rt.store
        if store.masters_pending():
            with self.phases("page-lock masters", "the masters that cross to the device as they are, page-locked "
                                                  "before the init writes them (the rest goes on beside it)"):
                store.masters_ready()
        with self.phases("initialize", "weights written into the fp32 masters"):
            if self.meta:
                materialize(self.model, store, lowered.layout, lowered.capture, lowered.device, self._generators)
            else:
                store.load_params([self.named[p.name] for p in lowered.capture.params])
        self._locked()
        if store.shadow:
            with self.phases("16-bit copies", "the masters cast into the copies that cross to the device"):
                store.masters_changed()
                if lowered.device.type == "cuda":
                    torch.cuda.synchronize(lowered.device)
