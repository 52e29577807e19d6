"""A meta-built model's init with its normal_ draws split over threads (runtime/parallel_init.py) gives the bits
one thread gives: the same tensors and the same generator state after, for a seed."""
import pytest
import torch

import pstar_fx
from pstar_fx.models import GPT, gpt_config
from pstar_fx.runtime import parallel_init
from test_engine import batch


@pytest.fixture
def small_pieces(monkeypatch):
    """Split every tensor of 64+ values into pieces of 48 (tiny models' tensors, many pieces each), and count
    the pieces the workers fill."""
    monkeypatch.setattr(parallel_init, "MIN_ELEMS", 64)
    monkeypatch.setattr(parallel_init, "PIECE_ELEMS", 48)
    monkeypatch.setattr(parallel_init, "MIN_THREADS", 1)          # split on any box (CI's may have 1 or 2 cores)
    filled = []
    fill = parallel_init._fill

    def counted(view, mean, std, state):
        filled.append(view.numel())
        fill(view, mean, std, state)

    monkeypatch.setattr(parallel_init, "_fill", counted)
    return filled


def an_init(ts):
    """What inits do: normal_ by position and keyword, uniform_ between them, in-place ops on drawn values, a
    second draw into the same tensor, and draws after the last."""
    for i, t in enumerate(ts):
        if i % 3 == 2:
            t.uniform_(-0.1, 0.1)
        torch.nn.init.normal_(t, mean=0.0, std=0.02)
        if i == 1:
            t.mul_(2.0)
            t[5:9].zero_()
        if i == 3:
            t.normal_(std=1.0)
    return torch.rand(3), torch.randn(5)


def test_split_draws_give_one_threads_bits_and_generator_state(small_pieces):
    assert parallel_init.same_bits_as_serial()
    shapes = [(40, 41), (1000,), (17,), (3, 1003), (64,), (65,), (7, 16)]
    torch.manual_seed(7)
    serial = [torch.empty(s) for s in shapes]
    drawn_after = an_init(serial)
    state_after = torch.get_rng_state()
    torch.manual_seed(7)
    split = [torch.empty(s) for s in shapes]
    with parallel_init.split_normal_draws(threads=3) as mode:
        split_after = an_init(split)
    assert mode is not None and mode.split_elems > 0 and len(small_pieces) > 20
    for a, b in zip(serial, split):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(drawn_after, split_after))
    assert torch.equal(state_after, torch.get_rng_state())


@pytest.mark.parametrize("threads", [2, 5])
def test_init_threads_from_the_environment_give_the_same_bits(small_pieces, monkeypatch, threads):
    shapes = [(40, 41), (1000,), (17,), (3, 1003)]
    torch.manual_seed(7)
    serial = [torch.empty(s) for s in shapes]
    an_init(serial)
    monkeypatch.setenv("PSTAR_FX_INIT_THREADS", str(threads))
    assert parallel_init.init_threads() == threads
    torch.manual_seed(7)
    split = [torch.empty(s) for s in shapes]
    with parallel_init.split_normal_draws() as mode:
        an_init(split)
    moved = parallel_init._state_mover() is not None      # (drawing through, one of them advances)
    assert mode is not None and mode.pool._max_workers == (threads if moved else threads - 1)
    assert all(torch.equal(a, b) for a, b in zip(serial, split))


def test_init_threads_refuses_a_count_below_one(monkeypatch):
    monkeypatch.setenv("PSTAR_FX_INIT_THREADS", "0")
    with pytest.raises(ValueError, match="PSTAR_FX_INIT_THREADS"):
        parallel_init.init_threads()


def test_split_pieces_start_at_multiples_of_16_and_cover_the_tensor():
    for n, piece in [(16, 48), (17, 48), (1000, 48), (64, 48), (63, 16), (10 ** 6 + 3, 1 << 16)]:
        pieces = parallel_init._pieces(n, piece)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a % 16 == 0 and b - a >= 16 for a, b in pieces)
        assert all(b == a2 for (_, b), (a2, _) in zip(pieces, pieces[1:]))


def serial_init(monkeypatch):
    """Today's init: one thread (the split declines where the layout of draws is not known)."""
    monkeypatch.setattr(parallel_init, "same_bits_as_serial", lambda: False)


def test_meta_gpt_initializes_in_chunk_memory_with_one_threads_bits(small_pieces, monkeypatch):
    config = {"device": "cpu", "placement": "host", "seed": 3, "chunk_size": 16384}
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    split = pstar_fx.compile(model, config, batch()).state_dict()
    assert sum(small_pieces) > 0.9 * sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight")
                                          and p.dim() == 2)
    torch.manual_seed(3)
    ref = GPT(gpt_config("tiny"))            # a CPU build, initialized on one thread with the same seed
    torch.manual_seed(3)
    ref.init_weights()
    for name, p in ref.named_parameters():
        assert torch.equal(split[name], p.detach()), name


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_meta_hf_model_initializes_with_one_threads_bits(small_pieces, monkeypatch, kind):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls, drawn = transformers.GPT2LMHeadModel, "transformer.h.0.attn.c_proj.weight"
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                       max_position_embeddings=64, head_dim=16)
        cls, drawn = transformers.LlamaForCausalLM, "model.layers.0.mlp.down_proj.weight"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    config = pstar_fx.Config(device="cpu", seed=5, chunk_size=16384)
    results = []
    for split in (True, False):
        if not split:
            serial_init(monkeypatch)
        with torch.device("meta"):
            model = cls(cfg)
        results.append(pstar_fx.compile(model, config, {"input_ids": ids, "labels": ids}).state_dict())
        if split:
            assert sum(small_pieces) > 0
            pieces = len(small_pieces)
    assert len(small_pieces) == pieces                  # the serial run split nothing
    assert results[0].keys() == results[1].keys()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k
    assert results[0][drawn].std() > 0                  # initialized, not left zero


def test_compile_sends_allocation_and_initialization_progress():
    events = []
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    with pstar_fx.phases.subscribe(events.append):
        pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384}, batch())
    for phase in ("allocate", "initialize"):
        sent = [e for e in events if e.phase == phase and e.state == "progress"]
        assert sent and sent[-1].done == sent[-1].total > 0, phase
        assert all(a.done <= b.done for a, b in zip(sent, sent[1:])), phase


def test_the_chunk_memory_is_allocated_and_the_init_started_as_soon_as_the_plan_is_made(monkeypatch):
    """One rank: compile() allocates the chunk memory once the plan step has made a plan that fits, before lowering
    and the regions pass, and the initial weights are written meanwhile (on their own thread: the regions pass here
    waits until the init has begun, which an init started after it would never do); the plan phase ends before the
    allocation starts. The weights equal those of the model's own init."""
    import threading

    import pstar_fx.startup as startup_mod
    from pstar_fx.passes import compile_regions
    initializing, seen = threading.Event(), []
    real_regions, real_materialize = compile_regions.compile_regions, startup_mod.materialize

    def regions(*args, **kw):
        seen.append(initializing.wait(timeout=30))
        return real_regions(*args, **kw)

    def materialize(*args):
        initializing.set()
        return real_materialize(*args)

    monkeypatch.setattr(compile_regions, "compile_regions", regions)
    monkeypatch.setattr(startup_mod, "materialize", materialize)
    events = []
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    torch.manual_seed(0)
    eager = GPT(gpt_config("tiny")).state_dict()
    with pstar_fx.phases.subscribe(events.append):
        engine = pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384, "seed": 0,
                                          "compute": "inductor"}, batch())
    order = [(e.phase, e.state) for e in events if e.state in ("start", "end")]
    at = {step: order.index(step) for step in order}
    assert at[("plan", "end")] < at[("allocate", "start")] < at[("allocate", "end")] < at[("lower", "start")]
    assert seen == [True]
    state = engine.state_dict()
    assert all(torch.equal(state[k], eager[k]) for k in eager)


def test_the_state_moved_forward_in_cpp_is_the_state_drawing_leaves():
    """kernels' mt19937_advance moves a CPU generator's state as drawing that many values does, from any point of
    a block of 624 and across twists; the values drawn after are the same."""
    from pstar_fx.kernels import cpu_adam
    move = getattr(cpu_adam.extension(), "mt19937_advance", None)
    if move is None:
        pytest.skip(f"the C++ kernels are not built here: {cpu_adam.extension()}")
    scratch = torch.empty(4096, dtype=torch.int64)
    for start in (0, 1, 5, 623, 624, 625, 1247, 1248, 3001):
        for draws in (0, 1, 2, 621, 622, 623, 624, 625, 1247, 1248, 1249, 10_000, 123_457):
            drawn, moved = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
            for g in (drawn, moved):
                parallel_init._draw_through(g, start, scratch)
            parallel_init._draw_through(drawn, draws, scratch)
            state = moved.get_state()
            move(state.data_ptr(), draws)
            moved.set_state(state)
            assert torch.equal(drawn.get_state(), moved.get_state()), (start, draws)
            assert torch.equal(torch.empty(100).normal_(generator=drawn), torch.empty(100).normal_(generator=moved))
    assert parallel_init._state_mover() is move          # the engine's init uses it here


def test_without_the_cpp_advance_the_split_draws_through_with_the_same_bits(small_pieces, monkeypatch):
    monkeypatch.setattr(parallel_init, "_state_mover", lambda: None)
    torch.manual_seed(3)
    ts = [torch.empty(200), torch.empty(130), torch.empty(64), torch.empty(97)]
    serial = an_init([t.clone() for t in ts]), torch.default_generator.get_state()
    torch.manual_seed(3)
    split_ts = [t.clone() for t in ts]
    with parallel_init.split_normal_draws(threads=3, piece_elems=48):
        tail = an_init(split_ts)
    assert torch.equal(torch.default_generator.get_state(), serial[1]) and small_pieces
    torch.manual_seed(3)
    ref = [t.clone() for t in ts]
    ref_tail = an_init(ref)
    assert all(torch.equal(a, b) for a, b in zip(ref, split_ts))
    assert all(torch.equal(a, b) for a, b in zip(ref_tail, tail))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_weights_split_with_one_threads_bits(small_pieces, dtype):
    """A frozen chunk's weights are 16-bit on the host: their normal_ splits too (checked per dtype), with the
    bits and generator state one thread gives."""
    assert parallel_init._same_bits_for(dtype)
    shapes = [(40, 41), (1000,), (17,), (3, 1003), (64,), (65,)]
    torch.manual_seed(5)
    serial = [torch.empty(s, dtype=dtype) for s in shapes]
    after = an_init(serial), torch.get_rng_state()
    torch.manual_seed(5)
    split = [torch.empty(s, dtype=dtype) for s in shapes]
    with parallel_init.split_normal_draws(threads=3) as mode:
        split_after = an_init(split)
    assert mode.split_elems > 0 and small_pieces
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(serial, split))
    assert all(torch.equal(a, b) for a, b in zip(after[0], split_after))
    assert torch.equal(after[1], torch.get_rng_state())


@pytest.mark.parametrize("dtype", parallel_init.SPLIT_DTYPES, ids=str)
def test_the_draws_a_normal_takes_are_this_torchs_for_every_length_and_dtype(dtype):
    """The split advances the generator past each piece by the draws one `normal_` of it takes; how many that is
    for a length not a multiple of 16 differs by dtype and by torch version (16-bit: the last block drawn again up
    to torch 2.11, rounded up to 16 later), so it is probed, and here held against the generator itself."""
    scratch = torch.empty(64, dtype=torch.int64)
    for n in (16, 17, 31, 48, 53, 16 * 9 + 15):
        gen = torch.Generator().manual_seed(n)
        start = gen.get_state()
        torch.empty(n, dtype=dtype).normal_(generator=gen)
        probe = torch.Generator()
        probe.set_state(start)
        parallel_init._draw_through(probe, parallel_init._draws(n, dtype), scratch)
        assert torch.equal(probe.get_state(), gen.get_state()), (dtype, n)


def test_an_init_on_its_own_generators_draws_what_it_would_from_the_global_ones():
    """`split_normal_draws(generators=own_generators(seed, cpu))`: every random op without a generator of its own
    (normal_, split or not; uniform_ under kaiming and trunc_normal_; the factories randn, rand, randint, randperm,
    whose generator takes another overload) draws from the block's generator: the values of an init after
    torch.manual_seed(seed), the global generator untouched meanwhile, and `settle` leaves it where that init
    does."""
    from pstar_fx.runtime.parallel_init import own_generators, settle

    def init(ts):
        for t in ts:
            t.normal_(0, 0.02)
        torch.nn.init.kaiming_uniform_(ts[1])
        torch.nn.init.trunc_normal_(ts[2][:1000], std=0.02)
        return [torch.randn(5), torch.rand(3), torch.randint(0, 10, (4,)), torch.randperm(7),
                torch.randint(10, (3,))]

    ts = [torch.empty(1 << 18), torch.empty(64, 64), torch.empty(1 << 17)]
    torch.manual_seed(7)
    made = init(ts)
    ref, ref_end = [t.clone() for t in ts] + made, torch.get_rng_state()
    gens = own_generators(7, torch.device("cpu"))
    torch.manual_seed(123)
    before = torch.get_rng_state()
    with parallel_init.split_normal_draws(2, generators=gens):
        made = init(ts)
    assert all(torch.equal(a, b) for a, b in zip(ref, ts + made))
    assert torch.equal(torch.get_rng_state(), before)
    settle(7, gens)
    assert torch.equal(torch.get_rng_state(), ref_end)


def test_the_init_beside_the_compile_gets_the_gil_promptly_and_the_interval_comes_back(monkeypatch):
    """While the initial weights are written on their own thread beside lowering and the region builds, the
    interpreter's switch interval is parallel_init.HANDOFF_S (the init asks for the GIL thousands of times; at the
    default 5 ms each ask waited behind the busy compiling thread); compile() leaves the interval as it found it,
    after an error too."""
    import sys

    import pstar_fx.startup as startup_mod
    seen, real_materialize = [], startup_mod.materialize

    def materialize(*args):
        seen.append(sys.getswitchinterval())
        return real_materialize(*args)

    monkeypatch.setattr(startup_mod, "materialize", materialize)
    before = sys.getswitchinterval()
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384}, batch())
    assert seen == [pytest.approx(min(before, parallel_init.HANDOFF_S), rel=0.02)]   # (kept in whole microseconds)
    assert sys.getswitchinterval() == before

    def failing(*args):
        seen.append(sys.getswitchinterval())
        raise RuntimeError("init failed")

    monkeypatch.setattr(startup_mod, "materialize", failing)
    with torch.device("meta"):
        model = GPT(gpt_config("tiny"))
    with pytest.raises(RuntimeError, match="init failed"):
        pstar_fx.compile(model, {"device": "cpu", "placement": "host", "chunk_size": 16384}, batch())
    assert len(seen) == 2 and seen[1] == seen[0]
    assert sys.getswitchinterval() == before


def test_prompt_handoffs_keeps_a_shorter_interval_already_set():
    import sys
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(parallel_init.HANDOFF_S / 2)
        with parallel_init.prompt_handoffs():
            assert sys.getswitchinterval() == pytest.approx(parallel_init.HANDOFF_S / 2, rel=0.02)
        with parallel_init.prompt_handoffs(1.0):
            assert sys.getswitchinterval() == pytest.approx(parallel_init.HANDOFF_S / 2, rel=0.02)
    finally:
        sys.setswitchinterval(before)


def test_overlapping_handoff_blocks_restore_the_interval_found_before_the_first():
    """Compiles on two threads: their blocks overlap and end in either order; the interval before the first
    comes back when the last ends, never the shorter one a block set."""
    import sys
    before = sys.getswitchinterval()
    a, b = parallel_init.prompt_handoffs(), parallel_init.prompt_handoffs(parallel_init.HANDOFF_S / 4)
    a.__enter__()
    b.__enter__()
    assert sys.getswitchinterval() == pytest.approx(parallel_init.HANDOFF_S / 4, rel=0.02)
    a.__exit__(None, None, None)                  # the first ends first: the other's interval stays
    assert sys.getswitchinterval() == pytest.approx(parallel_init.HANDOFF_S / 4, rel=0.02)
    b.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
    a, b = parallel_init.prompt_handoffs(), parallel_init.prompt_handoffs(parallel_init.HANDOFF_S / 4)
    a.__enter__()
    b.__enter__()
    b.__exit__(None, None, None)                  # the last ends first
    assert sys.getswitchinterval() == pytest.approx(parallel_init.HANDOFF_S, rel=0.02)
    a.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
