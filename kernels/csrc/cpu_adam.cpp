// pstar_fx.kernels._cpu_adam: fused Adam / AdamW, fp32 -> 16-bit casts and sums of squares on
// raw CPU memory, for flat chunks; and STREAM's triad, the yardstick the Adam is measured against.
//
// Bytes per element (what the memory system must move; the step is memory-bound):
//   adam_step  read p, m, v (12 B) + grad (4 B fp32 / 2 B bf16, fp16), write p, m, v (12 B),
//              + 2 B written for the optional 16-bit param copy,
//              + the non-finite pre-pass, which reads the grad once more (4 B / 2 B).
//              fp32 grads: 32 B (28 B of Adam + 4 B check); bf16 grads + bf16 copy: 30 B (28 B unchecked).
//              bf16 moments: 8 B less. int8 moments (codes + a 4 B scale per 256 elements each): read p 4,
//              codes 2, grad; write p 4, codes 2 (+ 0.06 B of scales): 16 B with fp32 grads, unchecked.
//   adam_undo  read p, m, v (12 B) + grad (4 B / 2 B), write p, m, v (12 B): 28 B / 26 B; a correction (the
//              redo) + 2 B for the 16-bit copy: 28 B with bf16 grads, as the Adam. The master alone: 16 B.
//              Same levels, blocks, stores and prefetch as adam_step; all levels give the old scalar kernel's bits
//              (its float64 quotients by the constants decay, b1, b2: see cpu_adam_impl.h).
//   cast       read 4 B, write 2 B = 6 B.
//   sq_sum     read 4 B (fp32) or 2 B (16-bit).
//   triad      12 B as STREAM counts it (read b, c, write a); a plain store also reads a's line first.
//
// Design:
//  - No libtorch: Python hands over data_ptr() integers, element counts and dtype names.
//  - The GIL is released for the whole computation so a Python thread can drive the GPU meanwhile.
//  - OpenMP hands out blocks of 64K elements dynamically (block boundaries are multiples of 64
//    elements, so threads never share a cache line of the 16-bit output).
//  - SIMD with run-time dispatch: cpu_adam_impl.h is compiled three times (AVX-512, AVX2, and
//    baseline x86-64, called "scalar" though GCC may use SSE2 there), each under its own
//    `#pragma GCC target`; the best level the CPU supports is chosen at import. One build runs
//    on any x86-64. fp16 conversions use explicit F16C / AVX-512 intrinsics because GCC 12 does
//    not vectorise _Float16 casts.
//  - Non-finite gradients: a pre-pass takes max |grad| (integer max over bit patterns, so it
//    vectorises) and the update runs only if every grad / grad_scale is finite. A failed check
//    writes nothing, so param, exp_avg, exp_avg_sq and the 16-bit copy stay bit-identical. The
//    pre-pass cannot be folded into the update without losing that (a NaN in the last block would
//    be found after the first blocks were written, and undoing a step is exact only to an ulp), so
//    it runs in the same parallel region, last block first: the blocks the update takes first are
//    the last ones read, so those that survive in cache are not read from memory twice (not measured
//    apart; for a chunk much larger than the L3 few survive, and the check costs its 2 B / 30 B).
//
// Stores, schedule and prefetch (adam_step's `stores`, `schedule`, `prefetch_elems`; the defaults live in
// kernels/cpu_adam.py), measured on the 16-core H200 box (Xeon, AVX-512, one NUMA node; 256M elements,
// bf16 grad, bf16 copy; bench/host_adam_bench.py --sweep, 5 processes, 2026-12-01):
//  - stores: "stream_out" (non-temporal stores for the 16-bit copy only) beat "plain" by 3-12% in all 10
//    comparisons: the copy is the one array not read first, so a plain store reads each line before
//    writing it. Non-temporal stores for p, m, v too were slower than "stream_out" in 4 of 5 (their
//    lines are in cache already, from the loads), and were dropped.
//  - schedule: "dynamic" beat "static" (one contiguous share per thread, as torch's parallel_for splits
//    its fused AdamW) by 8-17% in 4 of 5 processes and lost by 2% in one: in a VM the slowest static
//    share sets the time (a guess: what slows one vCPU was not measured).
//  - prefetch: 512 elements ahead into L1 was 6% (checked) and 9% (unchecked) faster than none, in one
//    process: it carries each stream across the 4 KiB page edges where the hardware prefetcher stops.
//  - threads: one per physical core (kernels/cpu_adam.py, default_threads()); 8 and 12 threads gave
//    less bandwidth than 16 for every kernel, the triad included.
#include <stdexcept>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__)
#define PSTAR_X86_DISPATCH 1
#include <immintrin.h>
#else
#define PSTAR_X86_DISPATCH 0
#endif

// GCC 12 warns about _mm512_undefined_ps() inside _mm512_cvtph_ps: a known false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#ifndef PSTAR_BUILD_FLAGS
#define PSTAR_BUILD_FLAGS "unknown"
#endif

namespace py = pybind11;

struct AdamCoeffs {
    float l2_wd;            // weight_decay in L2 mode (Adam: grad += wd * param)
    float decay;            // 1 - lr * weight_decay (AdamW: param *= decay)
    float beta1, one_minus_beta1, beta2, one_minus_beta2;
    float inv_bc2_sqrt;     // 1 / sqrt(1 - beta2^step)
    float step_size;        // lr / (1 - beta1^step)
    float eps;
    float grad_scale, inv_grad_scale;
    int scale_mode;         // 0: grad_scale == 1; 1: multiply by the exact 1/grad_scale; 2: divide
    int stores;             // 0 plain; 1 non-temporal stores for the 16-bit copy
    int prefetch_elems;     // software prefetch this far ahead (> 0: into L1, < 0: into L2), 0: none
    bool decoupled;
    bool copy_only;         // write the 16-bit copy alone: param and moments are read and left as they are
    // int8 moments: kernels/quant8.py's tables (exp_avg: signed; exp_avg_sq: unsigned): each map's 256 values,
    // and its buckets' bases and cuts (quant8._buckets: 2 * kQ8BucketsPerSign each)
    const float *q8_signed_map, *q8_unsigned_map, *q8_signed_cut, *q8_unsigned_cut;
    const int32_t *q8_signed_base, *q8_unsigned_base;
    const uint64_t *q8_signed_packed, *q8_unsigned_packed;   // each bucket's cut (low 32 bits) and base (high)
};

// adam_undo's coefficients, rounded to fp32 as adam_step rounds them (AdamCoeffs)
struct UndoCoeffs {
    float decay, l2_wd, b1, omb1, b2, omb2, inv_bc2_sqrt, step_size, eps;
    float scale, inv_scale, redo_scale, inv_redo;  // inv_*: 1 / scale, 1 when the scale is 1
    bool div_scale, div_redo;  // divide by the scale (its reciprocal is not exact) instead of multiplying
    bool decoupled, first;     // AdamW; step 1 (the moments come back as zeros)
    bool master_quotient;      // AdamW with decay != 1: the master is divided by it
    int stores, prefetch_elems;
    double recip[3][2];        // decay, b1, b2: 1/b as RD(1/b) + RN(remainder / b) >= 0 (the vector levels' quotients)
};

// An int8 moment's range: one code per element and one fp32 scale (the block's absmax) per kQ8Block elements,
// blocks from the range's first element (kernels/quant8.py, BLOCK_ELEMS)
constexpr int64_t kQ8Block = 256;
// quant8's buckets of a float's bits: |x| below 2^(kQ8MinExp - 127) in bucket 0, then 128 per octave up to 1
constexpr int32_t kQ8MinExp = 103;
constexpr int32_t kQ8BucketsPerSign = (127 - kQ8MinExp + 1) * 128 + 1;
struct Q8 {
    uint8_t* codes;
    float* absmax;
};

namespace simd_scalar {
#define PSTAR_SIMD 0
#include "cpu_adam_impl.h"
#undef PSTAR_SIMD
}  // namespace simd_scalar

#if PSTAR_X86_DISPATCH
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace simd_avx2 {
#define PSTAR_SIMD 1
#include "cpu_adam_impl.h"
#undef PSTAR_SIMD
}  // namespace simd_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,prefer-vector-width=512")
namespace simd_avx512 {
#define PSTAR_SIMD 2
#include "cpu_adam_impl.h"
#undef PSTAR_SIMD
}  // namespace simd_avx512
#pragma GCC pop_options
#endif

namespace {

struct Level {
    const char* name;
    bool (*supported)();
    void (*adam)(float*, const void*, int, float*, float*, void*, int, int64_t, const AdamCoeffs&);
    void (*adam_bf16m)(float*, const void*, int, uint16_t*, uint16_t*, void*, int, int64_t, const AdamCoeffs&);
    void (*adam_q8)(float*, const void*, int, Q8*, Q8*, void*, int, int64_t, const AdamCoeffs&);
    uint32_t (*max_abs)(const void*, int, int64_t);
    void (*cast)(void*, int, const float*, int64_t);
    double (*sq_sum)(const void*, int, int64_t);
    void (*triad)(float*, const float*, const float*, float, int64_t, bool);
    void (*undo)(float*, const void*, int, float*, float*, uint16_t*, int, int64_t, const UndoCoeffs&, int, bool);
};

bool always() { return true; }
#if PSTAR_X86_DISPATCH
bool has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
bool has_avx512() {
    __builtin_cpu_init();
    return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
#endif

// Best first.
const std::vector<Level>& levels() {
    static const std::vector<Level> all = {
#if PSTAR_X86_DISPATCH
        {"avx512", has_avx512, simd_avx512::adam_range<float>, simd_avx512::adam_range<uint16_t>,
         simd_avx512::adam_range<Q8>, simd_avx512::max_abs_bits, simd_avx512::cast_range,
         simd_avx512::sq_sum_range, simd_avx512::triad_range,
         simd_avx512::adam_undo_range},
        {"avx2", has_avx2, simd_avx2::adam_range<float>, simd_avx2::adam_range<uint16_t>,
         simd_avx2::adam_range<Q8>, simd_avx2::max_abs_bits, simd_avx2::cast_range,
         simd_avx2::sq_sum_range, simd_avx2::triad_range,
         simd_avx2::adam_undo_range},
#endif
        {"scalar", always, simd_scalar::adam_range<float>, simd_scalar::adam_range<uint16_t>,
         simd_scalar::adam_range<Q8>, simd_scalar::max_abs_bits, simd_scalar::cast_range,
         simd_scalar::sq_sum_range, simd_scalar::triad_range,
         simd_scalar::adam_undo_range},
    };
    return all;
}

const Level& pick(const std::string& simd) {
    for (const Level& l : levels()) {
        if (simd == "auto" && l.supported()) return l;
        if (simd == l.name) {
            if (!l.supported()) throw py::value_error("simd level '" + simd + "' is not supported by this CPU");
            return l;
        }
    }
    std::string names;
    for (const Level& l : levels()) names += std::string(" ") + l.name;
    throw py::value_error("unknown simd level '" + simd + "'; compiled:" + names + " (or auto)");
}

// 0 fp32, 1 bf16, 2 fp16
int dtype_code(const std::string& name, bool allow_fp32, const char* what) {
    if (name == "float32" && allow_fp32) return 0;
    if (name == "bfloat16") return 1;
    if (name == "float16") return 2;
    throw py::type_error(std::string(what) + ": unsupported dtype '" + name + "'");
}

int element_size(int code) { return code == 0 ? 4 : 2; }

void check_ptr(uintptr_t ptr, int esize, int64_t n, const char* what) {
    if (n > 0 && ptr == 0) throw py::value_error(std::string(what) + ": null pointer");
    if (ptr % (uintptr_t)esize != 0) throw py::value_error(std::string(what) + ": pointer not aligned to its element size");
}

int thread_count(int num_threads) {
#ifdef _OPENMP
    return num_threads > 0 ? num_threads : omp_get_max_threads();
#else
    (void)num_threads;
    return 1;
#endif
}

// Below this many elements a fork/join costs more than it saves.
constexpr int64_t kParallelMinElems = 1 << 15;
// Work is handed out in blocks (dynamic schedule): a thread the OS preempts — another process on
// the machine, or the training loop's own threads — holds up one block, not a static 1/T share.
constexpr int64_t kBlockElems = 1 << 16;

// A map's buckets packed, (base << 32) | cut's bits, one 8-byte load each (the AVX-512 and AVX2 levels gather half
// as many elements as two 4-byte tables take). Built once per table pair, with the GIL held.
const uint64_t* packed_buckets(const int32_t* base, const float* cut) {
    static std::vector<std::pair<std::pair<const int32_t*, const float*>, std::vector<uint64_t>>> made;
    for (const auto& entry : made)
        if (entry.first.first == base && entry.first.second == cut) return entry.second.data();
    std::vector<uint64_t> packed(2 * (size_t)kQ8BucketsPerSign);
    for (size_t i = 0; i < packed.size(); ++i) {
        uint32_t bits;
        std::memcpy(&bits, cut + i, 4);
        packed[i] = ((uint64_t)(uint32_t)base[i] << 32) | bits;
    }
    made.emplace_back(std::make_pair(base, cut), std::move(packed));
    return made.back().second.data();
}

int threads_for(int64_t n, int num_threads) { return n < kParallelMinElems ? 1 : thread_count(num_threads); }

struct Blocks {
    int64_t n, count;
    explicit Blocks(int64_t n_) : n(n_), count((n_ + kBlockElems - 1) / kBlockElems) {}
    int64_t begin(int64_t b) const { return b * kBlockElems; }
    int64_t size(int64_t b) const { return b * kBlockElems + kBlockElems < n ? kBlockElems : n - b * kBlockElems; }
};

template <class T>
T* at(uintptr_t base, int64_t index) { return reinterpret_cast<T*>(base) + index; }

// A thread's share of [0, n) under the static schedule: contiguous, a multiple of `align` elements long (64:
// no two threads write one cache line of the 16-bit copy; int8 moments: whole quantization blocks), the last
// one shorter.
struct Share {
    int64_t lo, hi;
    Share(int64_t n, int t, int nthreads, int64_t align = 64) {
        int64_t per = (n + nthreads - 1) / nthreads;
        per = (per + align - 1) / align * align;
        lo = std::min(n, (int64_t)t * per);
        hi = std::min(n, lo + per);
    }
};

int stores_code(const std::string& stores) {
    if (stores == "plain") return 0;
    if (stores == "stream_out") return 1;
    throw py::value_error("stores must be 'plain' or 'stream_out', got '" + stores + "'");
}

bool static_schedule(const std::string& schedule) {
    if (schedule == "static") return true;
    if (schedule == "dynamic") return false;
    throw py::value_error("schedule must be 'static' or 'dynamic', got '" + schedule + "'");
}

// The non-finite check reads a thread's share backwards in blocks of this many elements, so the share's
// first blocks — the ones its update reads first — are the ones still in cache when the update starts.
constexpr int64_t kCheckBlockElems = 1 << 14;

bool adam_step(uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg,
               uintptr_t exp_avg_sq, uintptr_t param_out, const std::string& out_dtype, int64_t n, int64_t step,
               double lr, double beta1, double beta2, double eps, double weight_decay, double grad_scale,
               bool decoupled, bool check_finite, const std::string& simd, int num_threads,
               const std::string& stores, const std::string& schedule, int prefetch_elems,
               const std::string& moments_dtype, uintptr_t exp_avg_absmax, uintptr_t exp_avg_sq_absmax,
               const std::vector<uintptr_t>& q8_tables, bool copy_only) {
    if (n < 0) throw py::value_error("adam_step: negative element count");
    if (copy_only && (param_out == 0 || moments_dtype == "uint8"))
        throw py::value_error("adam_step: copy_only writes the 16-bit copy alone: it needs param_out, and fp32 or "
                              "bf16 moments");
    if (moments_dtype != "float32" && moments_dtype != "bfloat16" && moments_dtype != "uint8")
        throw py::value_error("adam_step: moments_dtype must be 'float32', 'bfloat16' or 'uint8', got '" +
                              moments_dtype + "'");
    const bool bf16m = moments_dtype == "bfloat16";
    const bool q8m = moments_dtype == "uint8";
    if (q8m && q8_tables.size() != 6)
        throw py::value_error("adam_step: uint8 moments need q8_tables (quant8.cpu_tables(): the signed map, its "
                              "bucket bases and cuts, the unsigned map, its bases and cuts)");
    if (step < 1) throw py::value_error("adam_step: step must be >= 1 (1-based, after increment)");
    if (!(grad_scale > 0.0) || grad_scale == HUGE_VAL)
        throw py::value_error("adam_step: grad_scale must be positive and finite");
    const Level& L = pick(simd);
    const int gcode = dtype_code(grad_dtype, true, "adam_step grad");
    const int ocode = param_out == 0 ? -1 : dtype_code(out_dtype, false, "adam_step param_out");
    const bool is_static = static_schedule(schedule);
    check_ptr(param, 4, n, "param");
    check_ptr(exp_avg, q8m ? 1 : bf16m ? 2 : 4, n, "exp_avg");
    check_ptr(exp_avg_sq, q8m ? 1 : bf16m ? 2 : 4, n, "exp_avg_sq");
    if (q8m) {
        check_ptr(exp_avg_absmax, 4, n, "exp_avg_absmax");
        check_ptr(exp_avg_sq_absmax, 4, n, "exp_avg_sq_absmax");
        for (uintptr_t t : q8_tables) check_ptr(t, 4, 1, "q8_tables");
    }
    check_ptr(grad, element_size(gcode), n, "grad");
    if (ocode >= 0) check_ptr(param_out, 2, n, "param_out");

    AdamCoeffs c;
    c.decoupled = decoupled;
    c.copy_only = copy_only;
    c.stores = stores_code(stores);
    c.prefetch_elems = prefetch_elems;
    c.l2_wd = (float)weight_decay;
    c.decay = (float)(1.0 - lr * weight_decay);
    c.beta1 = (float)beta1;
    c.one_minus_beta1 = (float)(1.0 - beta1);
    c.beta2 = (float)beta2;
    c.one_minus_beta2 = (float)(1.0 - beta2);
    const double bc1 = 1.0 - std::pow(beta1, (double)step);
    const double bc2 = 1.0 - std::pow(beta2, (double)step);
    c.inv_bc2_sqrt = (float)(1.0 / std::sqrt(bc2));
    c.step_size = (float)(lr / bc1);
    c.eps = (float)eps;
    c.grad_scale = (float)grad_scale;
    c.inv_grad_scale = 1.0f / c.grad_scale;
    int exponent;
    const bool pow2 = std::frexp((double)c.grad_scale, &exponent) == 0.5 && std::isnormal(c.inv_grad_scale);
    c.scale_mode = c.grad_scale == 1.0f ? 0 : pow2 ? 1 : 2;
    c.q8_signed_map = c.q8_unsigned_map = c.q8_signed_cut = c.q8_unsigned_cut = nullptr;
    c.q8_signed_base = c.q8_unsigned_base = nullptr;
    c.q8_signed_packed = c.q8_unsigned_packed = nullptr;
    if (q8m) {
        c.q8_signed_map = reinterpret_cast<const float*>(q8_tables[0]);
        c.q8_signed_base = reinterpret_cast<const int32_t*>(q8_tables[1]);
        c.q8_signed_cut = reinterpret_cast<const float*>(q8_tables[2]);
        c.q8_unsigned_map = reinterpret_cast<const float*>(q8_tables[3]);
        c.q8_unsigned_base = reinterpret_cast<const int32_t*>(q8_tables[4]);
        c.q8_unsigned_cut = reinterpret_cast<const float*>(q8_tables[5]);
        c.q8_signed_packed = packed_buckets(c.q8_signed_base, c.q8_signed_cut);
        c.q8_unsigned_packed = packed_buckets(c.q8_unsigned_base, c.q8_unsigned_cut);
    }

    // Every grad / grad_scale is finite iff the largest |grad| is finite and stays finite when
    // unscaled (division by a positive constant is monotonic).
    auto all_finite = [&c](uint32_t max_abs) {
        if (max_abs >= 0x7F800000u) return false;
        float biggest;
        std::memcpy(&biggest, &max_abs, 4);
        return c.scale_mode == 0 ? true
             : c.scale_mode == 1 ? std::isfinite(biggest * c.inv_grad_scale)
                                 : std::isfinite(biggest / c.grad_scale);
    };
    const int es = element_size(gcode);
    auto update = [&](int64_t i, int64_t len) {   // i: a multiple of kQ8Block (64K blocks, aligned shares)
        if (q8m) {
            Q8 mq{at<uint8_t>(exp_avg, i), at<float>(exp_avg_absmax, i / kQ8Block)};
            Q8 vq{at<uint8_t>(exp_avg_sq, i), at<float>(exp_avg_sq_absmax, i / kQ8Block)};
            L.adam_q8(at<float>(param, i), at<const char>(grad, i * es), gcode, &mq, &vq,
                      ocode >= 0 ? at<uint16_t>(param_out, i) : nullptr, ocode, len, c);
            return;
        }
        if (bf16m) {
            L.adam_bf16m(at<float>(param, i), at<const char>(grad, i * es), gcode, at<uint16_t>(exp_avg, i),
                         at<uint16_t>(exp_avg_sq, i), ocode >= 0 ? at<uint16_t>(param_out, i) : nullptr, ocode, len, c);
            return;
        }
        L.adam(at<float>(param, i), at<const char>(grad, i * es), gcode, at<float>(exp_avg, i), at<float>(exp_avg_sq, i),
               ocode >= 0 ? at<uint16_t>(param_out, i) : nullptr, ocode, len, c);
    };
    const Blocks blocks(n);
    const int nt = threads_for(n, num_threads);
    uint32_t mx = 0;
    {
        py::gil_scoped_release no_gil;
        // One parallel region: pass 1 reads only the grad, and nothing is written before every thread has
        // seen its part (the reduction's barrier); pass 2 is the update, the 16-bit copy written from registers.
#pragma omp parallel num_threads(nt) if (nt > 1)
        {
#ifdef _OPENMP
            const int t = omp_get_thread_num(), team = omp_get_num_threads();
#else
            const int t = 0, team = 1;
#endif
            if (is_static) {
                const Share share(n, t, team, q8m ? kQ8Block : 64);
                if (check_finite) {
#pragma omp for schedule(static, 1) reduction(max : mx)
                    for (int tt = 0; tt < team; ++tt) {  // one iteration per thread: its own share
                        for (int64_t hi = share.hi; hi > share.lo; hi -= kCheckBlockElems) {
                            const int64_t lo = std::max(share.lo, hi - kCheckBlockElems);
                            const uint32_t r = L.max_abs(at<const char>(grad, lo * es), gcode, hi - lo);
                            mx = r > mx ? r : mx;
                        }
                    }
                }
                if (all_finite(mx) && share.hi > share.lo) update(share.lo, share.hi - share.lo);
            } else {
                if (check_finite) {
                    // last block first: the blocks the update takes first are the last ones read here
#pragma omp for schedule(dynamic, 1) reduction(max : mx)
                    for (int64_t k = 0; k < blocks.count; ++k) {
                        const int64_t b = blocks.count - 1 - k;
                        const uint32_t r = L.max_abs(at<const char>(grad, blocks.begin(b) * es), gcode, blocks.size(b));
                        mx = r > mx ? r : mx;
                    }
                }
                if (all_finite(mx)) {
#pragma omp for schedule(dynamic, 1)
                    for (int64_t b = 0; b < blocks.count; ++b) update(blocks.begin(b), blocks.size(b));
                }
            }
        }
    }
    return all_finite(mx);
}

// STREAM's triad a[i] = b[i] + s * c[i] over float32, `reps` times; the best time in seconds. Threads take
// static contiguous shares, as the static Adam does; nt: non-temporal stores for a.
double stream_triad(uintptr_t a, uintptr_t b, uintptr_t c, int64_t n, double scalar, int reps, bool nt,
                    const std::string& simd, int num_threads) {
    if (n < 0 || reps < 1) throw py::value_error("stream_triad: n must be >= 0 and reps >= 1");
    const Level& L = pick(simd);
    check_ptr(a, 4, n, "a");
    check_ptr(b, 4, n, "b");
    check_ptr(c, 4, n, "c");
    const int nt_ = thread_count(num_threads);
    const float s = (float)scalar;
    double best = HUGE_VAL;
    py::gil_scoped_release no_gil;
    for (int r = 0; r < reps; ++r) {
#ifdef _OPENMP
        const double t0 = omp_get_wtime();
#endif
#pragma omp parallel num_threads(nt_) if (nt_ > 1)
        {
#ifdef _OPENMP
            const Share share(n, omp_get_thread_num(), omp_get_num_threads());
#else
            const Share share(n, 0, 1);
#endif
            if (share.hi > share.lo)
                L.triad(at<float>(a, share.lo), at<const float>(b, share.lo), at<const float>(c, share.lo), s,
                        share.hi - share.lo, nt);
        }
#ifdef _OPENMP
        best = std::min(best, omp_get_wtime() - t0);
#else
        best = 0.0;
#endif
    }
    return best;
}

// The inverse of adam_step: given the state after a step and the grad that step consumed, the state
// before it. The step's update term is recomputed from the updated moments in the same fp32 operations
// adam_step used (so it is the same bits), and the subtractions are undone in double: the master comes
// back to within an ulp or two; a moment loses only what rounding took from its updated value (after
// step 1 the moments are restored to their exact zeros).
//
// part: 0 everything; 1 the master only, from the updated moments (no grad is read: the first half of a
// replay, before the step runs again); 2 the moments only, the master being already restored (the second
// half: the grad comes again from the replayed backward).
//
// With redo_scale > 0 the same pass then applies the step again with grad / redo_scale instead of
// grad / grad_scale (a correction: the speculative step used a guessed clip coefficient), in adam_step's
// arithmetic, writing the 16-bit copy too: one pass instead of two.
//
// The kernel (cpu_adam_impl.h, adam_undo_range) runs at the Adam's SIMD levels, in the Adam's blocks, stores
// and prefetch; its float64 quotients are exact reciprocal steps on the vector levels and IEEE divisions on
// the scalar level, which give the same bits: every level gives the old scalar kernel's result bit for bit
// (tests/test_kernels.py). Bytes per element: 28 B (fp32 grad) / 26 B (16-bit), + 2 B for the redo's
// 16-bit copy; the master alone (part 1) 16 B; the corrected 16-bit copy alone (part 3: read p, m, v, grad,
// write the copy) 16 B (bf16 grad) of memory, but all of the correction's arithmetic.
// Parts 4 and 5: a correction in one fp32 pass from the updated state (no undo, no float64: rescale_elems in
// cpu_adam_impl.h), and its 16-bit copy alone; the same bytes as parts 0 and 3 with a redo, a fraction of the
// arithmetic. Every level gives the scalar level's bits.
void adam_undo(uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg,
               uintptr_t exp_avg_sq, int64_t n, int64_t step, double lr, double beta1, double beta2, double eps,
               double weight_decay, double grad_scale, bool decoupled, double redo_scale, uintptr_t param_out,
               const std::string& out_dtype, int part, int num_threads, const std::string& simd,
               const std::string& stores, int prefetch_elems) {
    if (part < 0 || part > 5) throw py::value_error("adam_undo: part must be 0 to 5");
    if ((part == 3 || part == 5) && (param_out == 0 || !(redo_scale > 0.0)))
        throw py::value_error("adam_undo: parts 3 and 5 (a corrected 16-bit copy only) need redo_scale and param_out");
    if (part == 4 && !(redo_scale > 0.0))
        throw py::value_error("adam_undo: part 4 (the one-pass correction) needs redo_scale");
    if (n < 0) throw py::value_error("adam_undo: negative element count");
    if (step < 1) throw py::value_error("adam_undo: step must be >= 1 (1-based, after increment)");
    const Level& chosen = pick(simd);
    const int gcode = dtype_code(grad_dtype, true, "adam_undo grad");
    const int ocode = param_out == 0 ? -1 : dtype_code(out_dtype, false, "adam_undo param_out");
    check_ptr(param, 4, n, "param");
    check_ptr(exp_avg, 4, n, "exp_avg");
    check_ptr(exp_avg_sq, 4, n, "exp_avg_sq");
    if (part != 1) check_ptr(grad, element_size(gcode), n, "grad");
    if (param_out != 0) check_ptr(param_out, 2, n, "param_out");
    UndoCoeffs k;
    k.decay = (float)(1.0 - lr * weight_decay);
    k.l2_wd = (float)weight_decay;
    k.b1 = (float)beta1, k.omb1 = (float)(1.0 - beta1), k.b2 = (float)beta2, k.omb2 = (float)(1.0 - beta2);
    k.inv_bc2_sqrt = (float)(1.0 / std::sqrt(1.0 - std::pow(beta2, (double)step)));
    k.step_size = (float)(lr / (1.0 - std::pow(beta1, (double)step)));
    k.eps = (float)eps;
    k.decoupled = decoupled;
    k.first = step == 1;
    // grad / scale as adam_step takes it: times the reciprocal when that is exact (a power of two, or 1)
    auto scale_by = [](double value, float& scale, float& inv, bool& div) {
        scale = (float)value, inv = 1.0f / scale;
        int exponent;
        const bool pow2 = std::frexp((double)scale, &exponent) == 0.5 && std::isnormal(inv);
        div = !(scale == 1.0f || pow2);
        if (scale == 1.0f) inv = 1.0f;
    };
    const bool redo = redo_scale > 0.0 && part != 1;
    scale_by(grad_scale, k.scale, k.inv_scale, k.div_scale);
    scale_by(redo ? redo_scale : 1.0, k.redo_scale, k.inv_redo, k.div_redo);
    k.stores = stores_code(stores);
    k.prefetch_elems = prefetch_elems;
    // 1/b in two parts for reciprocal_quotient (cpu_adam_impl.h): inv = RD(1/b), the rest lo = (1 - inv*b)/b >= 0
    // (1 - inv*b is exact as an FMA: it is below 2^-51 and a multiple of ulp(inv) ulp(b)); unused unless b > 0
    auto split = [](float bf, double* r) {
        const double b = bf, inv = 1.0 / b;
        r[0] = std::fma(-inv, b, 1.0) < 0.0 ? std::nextafter(inv, 0.0) : inv;
        r[1] = std::fma(-r[0], b, 1.0) / b;
    };
    split(k.decay, k.recip[0]), split(k.b1, k.recip[1]), split(k.b2, k.recip[2]);
    k.master_quotient = decoupled && k.decay != 1.0f;  // x / 1 is x: weight decay 0 needs no quotient
    // The vector levels' quotients need each divisor used positive, finite and no power of two (lo > 0: an inf
    // would meet lo = 0 as inf * 0 = NaN); otherwise (b1 = 0.5, an AdamW decay 1 - lr*wd <= 0) the scalar
    // level's divisions run.
    auto reciprocal_ok = [](float b, const double* r) { return b > 0.0f && std::isfinite(b) && r[1] > 0.0; };
    const bool exact = (!k.master_quotient || reciprocal_ok(k.decay, k.recip[0])) &&
                       (!(k.b1 > 0.0f) || reciprocal_ok(k.b1, k.recip[1])) &&
                       (!(k.b2 > 0.0f) || reciprocal_ok(k.b2, k.recip[2]));
    const Level& L = exact || part >= 4 ? chosen : levels().back();   // parts 4, 5 divide by no constant
    float* p = reinterpret_cast<float*>(param);
    float* m = reinterpret_cast<float*>(exp_avg);
    float* v = reinterpret_cast<float*>(exp_avg_sq);
    const Blocks blocks(n);
    const int nt = threads_for(n, num_threads);
    const int es = element_size(gcode);
    py::gil_scoped_release no_gil;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks.count; ++b) {
        const int64_t i = blocks.begin(b);
        L.undo(p + i, part == 1 ? nullptr : at<const char>(grad, i * es), gcode, m + i, v + i,
               param_out == 0 ? nullptr : at<uint16_t>(param_out, i), ocode, blocks.size(b), k, part, redo);
    }
}

void cast(uintptr_t dst, const std::string& dst_dtype, uintptr_t src, int64_t n, const std::string& simd,
          int num_threads) {
    if (n < 0) throw py::value_error("cast: negative element count");
    const Level& L = pick(simd);
    const int dcode = dtype_code(dst_dtype, false, "cast dst");
    check_ptr(dst, 2, n, "dst");
    check_ptr(src, 4, n, "src");
    const Blocks blocks(n);
    const int nt = threads_for(n, num_threads);
    py::gil_scoped_release no_gil;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks.count; ++b)
        L.cast(at<uint16_t>(dst, blocks.begin(b)), dcode, at<const float>(src, blocks.begin(b)), blocks.size(b));
}

double sq_sum(uintptr_t x, const std::string& dtype, int64_t n, const std::string& simd, int num_threads) {
    if (n < 0) throw py::value_error("sq_sum: negative element count");
    const Level& L = pick(simd);
    const int code = dtype_code(dtype, true, "sq_sum");
    const int es = element_size(code);
    check_ptr(x, es, n, "x");
    const Blocks blocks(n);
    const int nt = threads_for(n, num_threads);
    std::vector<double> partial(blocks.count, 0.0);
    py::gil_scoped_release no_gil;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(dynamic, 1)
    for (int64_t b = 0; b < blocks.count; ++b)
        partial[b] = L.sq_sum(at<const char>(x, blocks.begin(b) * es), code, blocks.size(b));
    double acc = 0.0;  // summed in block order: the same bits on every run and thread count
    for (double p : partial) acc += p;
    return acc;
}

py::dict build_info() {
    py::dict d;
    d["simd"] = pick("auto").name;
    std::vector<std::string> compiled, supported;
    for (const Level& l : levels()) {
        compiled.push_back(l.name);
        if (l.supported()) supported.push_back(l.name);
    }
    d["simd_compiled"] = compiled;
    d["simd_supported"] = supported;
#ifdef _OPENMP
    d["openmp"] = true;
    d["max_threads"] = omp_get_max_threads();
#else
    d["openmp"] = false;
    d["max_threads"] = 1;
#endif
#ifdef __VERSION__
    d["compiler"] = __VERSION__;
#endif
    d["flags"] = PSTAR_BUILD_FLAGS;
    d["q8_block_elems"] = kQ8Block;
    d["q8_buckets"] = std::vector<int32_t>{kQ8MinExp, kQ8BucketsPerSign};
    return d;
}

// ---- mt19937: torch's CPU generator moved forward without drawing -----------------------------------------------
// runtime/parallel_init.py hands each piece of a large normal_ to a worker with the generator's state at that
// piece's first draw; finding those states by drawing through the stream (int64 random_) bound the whole init on
// the H200 box (~0.5 G draws/s). This moves the state itself: one twist per 624 draws, no tempering, no output.
// The state is the bytes torch.Generator.get_state() returns (ATen's legacy THGeneratorState layout: `left` int32
// at byte 8, `next` uint64 at 16, the 624 state words as uint64 at 24) and is edited in place; the Python side
// checks the result against drawing (parallel_init._state_mover) before trusting it.
constexpr int kMtN = 624, kMtM = 397;

inline uint32_t mt_twist(uint32_t u, uint32_t v) {
    return (((u & 0x80000000u) | (v & 0x7fffffffu)) >> 1) ^ ((0u - (v & 1u)) & 0x9908b0dfu);
}

void mt_next_state(uint32_t* s) {   // ATen's next_state, in three loops without a carried dependence (vectorized)
    for (int i = 0; i < kMtN - kMtM; ++i) s[i] = s[i + kMtM] ^ mt_twist(s[i], s[i + 1]);
    for (int i = kMtN - kMtM; i < kMtN - 1; ++i) s[i] = s[i + kMtM - kMtN] ^ mt_twist(s[i], s[i + 1]);
    s[kMtN - 1] = s[kMtM - 1] ^ mt_twist(s[kMtN - 1], s[0]);
}

void mt19937_advance(uintptr_t state_bytes, uint64_t draws) {
    py::gil_scoped_release no_gil;
    char* base = reinterpret_cast<char*>(state_bytes);
    int32_t left;
    uint64_t next;
    std::memcpy(&left, base + 8, sizeof left);
    std::memcpy(&next, base + 16, sizeof next);
    if (left < 1 || left > kMtN) throw std::invalid_argument("mt19937_advance: not a CPU generator state");
    const uint64_t before_twist = static_cast<uint64_t>(left) - 1;   // draws that read the current words
    if (draws <= before_twist) {
        left -= static_cast<int32_t>(draws);
        next += draws;
    } else {
        uint32_t s[kMtN];
        for (int i = 0; i < kMtN; ++i) {
            uint64_t w;
            std::memcpy(&w, base + 24 + 8 * i, sizeof w);
            s[i] = static_cast<uint32_t>(w);
        }
        const uint64_t rest = draws - before_twist;     // each block of 624 starts with a twist
        const uint64_t blocks = rest / kMtN, partial = rest % kMtN;
        for (uint64_t b = 0; b < blocks + (partial ? 1 : 0); ++b) mt_next_state(s);
        left = partial ? static_cast<int32_t>(kMtN + 1 - partial) : 1;
        next = partial ? partial : kMtN;
        for (int i = 0; i < kMtN; ++i) {
            uint64_t w = s[i];
            std::memcpy(base + 24 + 8 * i, &w, sizeof w);
        }
    }
    std::memcpy(base + 8, &left, sizeof left);
    std::memcpy(base + 16, &next, sizeof next);
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
    m.doc() = "Fused Adam/AdamW, fp32->bf16/fp16 casts and sums of squares on raw CPU pointers (see cpu_adam.cpp)";
    m.def("adam_step", &adam_step, py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("param_out"), py::arg("out_dtype"), py::arg("n"), py::arg("step"),
          py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::arg("grad_scale"), py::arg("decoupled"), py::arg("check_finite") = true, py::arg("simd") = "auto",
          py::arg("num_threads") = 0, py::arg("stores") = "plain", py::arg("schedule") = "dynamic",
          py::arg("prefetch_elems") = 0, py::arg("moments_dtype") = "float32", py::arg("exp_avg_absmax") = 0,
          py::arg("exp_avg_sq_absmax") = 0, py::arg("q8_tables") = std::vector<uintptr_t>(),
          py::arg("copy_only") = false,
          "In-place Adam/AdamW step on fp32 param and fp32, bf16 or int8 (uint8 codes + fp32 block scales) "
          "exp_avg/exp_avg_sq; returns False (nothing written) if any grad / grad_scale is not finite. copy_only: "
          "the step's 16-bit param_out alone (fp32 or bf16 moments; param and moments left as they are).");
    m.def("stream_triad", &stream_triad, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("n"),
          py::arg("scalar") = 3.0, py::arg("reps") = 5, py::arg("nt") = false, py::arg("simd") = "auto",
          py::arg("num_threads") = 0,
          "STREAM triad a = b + scalar * c on float32 pointers; best of reps, in seconds.");
    m.def("adam_undo", &adam_undo, py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("n"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
          py::arg("eps"), py::arg("weight_decay"), py::arg("grad_scale"), py::arg("decoupled"),
          py::arg("redo_scale") = 0.0, py::arg("param_out") = 0, py::arg("out_dtype") = "", py::arg("part") = 0,
          py::arg("num_threads") = 0, py::arg("simd") = "auto", py::arg("stores") = "plain",
          py::arg("prefetch_elems") = 0,
          "Undo one adam_step given the grad it consumed; with redo_scale > 0 apply it again with that "
          "grad scale in the same pass (see cpu_adam.cpp).");
    m.def("cast", &cast, py::arg("dst"), py::arg("dst_dtype"), py::arg("src"), py::arg("n"),
          py::arg("simd") = "auto", py::arg("num_threads") = 0,
          "fp32 -> bfloat16/float16, round to nearest even.");
    m.def("sq_sum", &sq_sum, py::arg("x"), py::arg("dtype"), py::arg("n"), py::arg("simd") = "auto",
          py::arg("num_threads") = 0, "Sum of squares, float64 accumulation.");
    m.def("mt19937_advance", &mt19937_advance, py::arg("state"), py::arg("draws"),
          "Move a torch CPU generator state (get_state()'s bytes, edited in place) forward by `draws` 32-bit draws.");
    m.def("build_info", &build_info, "Which SIMD level runs here, what was compiled, OpenMP, compiler, flags.");
}
