// Per-instruction-set kernel bodies for cpu_adam.cpp. NO include guard: this file is included
// once per SIMD level, each time inside its own namespace and under its own `#pragma GCC target`,
// with PSTAR_SIMD set to 0 (scalar), 1 (AVX2+FMA+F16C) or 2 (AVX-512 F/BW/VL/DQ).
//
// Everything here lives in that per-level namespace and uses only builtins and intrinsics, never
// std:: templates, so no inline function compiled for AVX-512 can be picked by the linker for
// use on a machine without it (the usual ODR trap of per-file ISA flags).
//
// Numerics: plain IEEE float32 arithmetic, same operation order on every level, and the build
// passes -ffp-contract=off, so all three levels give bit-identical results.

// ---------------------------------------------------------------- 16-bit conversions

static inline uint32_t f32_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

// fp32 -> bf16, round to nearest even; NaN stays NaN (quiet bit set, sign and top payload kept).
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = (u >> 16) | 0x0040u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : r);
}

static inline float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

// Software fp32 -> fp16, round to nearest even, exact on subnormals / overflow / inf / NaN.
// Used by the scalar level and for tails; the SIMD levels use F16C / AVX-512 vcvtps2ph, which
// round the same way (imm8 = 0: round to nearest even).
static inline uint16_t f32_to_f16_soft(float f) {
    uint32_t u = f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN, quiet
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);      // >= 65520 rounds to inf
    if (a < 0x38800000u) {                                        // below 2^-14: fp16 subnormal
        // Adding 0.5 puts the value's 2^-24 ulp into the low mantissa bits; the FPU rounds (RNE).
        float t = bits_f32(a) + 0.5f;
        return (uint16_t)(sign | (f32_bits(t) - 0x3F000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xC8000FFFu + odd;                                       // rebias exponent, round half even
    return (uint16_t)(sign | (a >> 13));
}

static inline float f16_to_f32_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t em = h & 0x7FFFu;
    if (em >= 0x7C00u) return bits_f32(sign | 0x7F800000u | ((em & 0x3FFu) << 13));
    if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));
    return bits_f32(sign | f32_bits((float)em * 5.9604644775390625e-08f));  // em * 2^-24, exact
}

// ---------------------------------------------------------------- vectors of this level

// Scalar ops: the whole of level 0, and the tails of the vector levels.
struct ScalarOps {
    typedef float T;
    static constexpr int64_t W = 1;
    static inline T set(float x) { return x; }
    static inline T load(const float* p) { return *p; }
    static inline void store(float* p, T x) { *p = x; }
    static inline T add(T a, T b) { return a + b; }
    static inline T sub(T a, T b) { return a - b; }
    static inline T mul(T a, T b) { return a * b; }
    static inline T div(T a, T b) { return a / b; }
    static inline T sqrt(T a) { return __builtin_sqrtf(a); }
    static inline T load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
    static inline T load_f16(const uint16_t* p) { return f16_to_f32_soft(*p); }
    static inline void store_bf16(uint16_t* p, T x) { *p = f32_to_bf16(x); }
    static inline void store_f16(uint16_t* p, T x) { *p = f32_to_f16_soft(x); }
    static constexpr bool kCanStream = false;
    static inline void stream(float* p, T x) { *p = x; }
    static inline void stream_bf16(uint16_t* p, T x) { *p = f32_to_bf16(x); }
    static inline void stream_f16(uint16_t* p, T x) { *p = f32_to_f16_soft(x); }
    static inline void fence() {}
    // int8 moments (kernels/quant8.py): a map's value at each code; the code of x, how many of the map's
    // thresholds lie below it, as base[bucket] + (cut[bucket] < x) (q8_bucket: a bucket of x's float bits holds
    // at most one threshold); |x|; max as (a > b ? a : b), which is what maxps computes lane by lane.
    static inline T gather(const float* table, const uint8_t* code) { return table[*code]; }
    static inline void store_code(uint8_t* dst, T x, const int32_t* base, const float* cut, const uint64_t*) {
        const uint32_t u = f32_bits(x);
        uint32_t e = (u >> 23) & 0xFFu;
        e = e > 127u ? 127u : e;
        const uint32_t b = (e < (uint32_t)kQ8MinExp ? 0u : ((e - kQ8MinExp) << 7) + ((u >> 16) & 0x7Fu) + 1u) +
                           (u >> 31) * (uint32_t)kQ8BucketsPerSign;
        *dst = (uint8_t)(base[b] + (cut[b] < x ? 1 : 0));
    }
    static inline T abs(T a) { return __builtin_fabsf(a); }
    static inline T max(T a, T b) { return a > b ? a : b; }
    static inline float hmax(T a) { return a; }
    // float64, for the undo (adam_undo_range): a float vector's values widened into kHalves vectors of doubles
    // and narrowed back (round to nearest even). The quotient is IEEE division here: this level is the reference
    // the vector levels' reciprocal steps reproduce, and the vector levels' tails.
    typedef double D;
    static constexpr int kHalves = 1;
    static inline D widen(T x, int) { return (double)x; }
    static inline D widen_load(const float* p, int) { return (double)*p; }
    static inline T narrow(const D* d) { return (float)d[0]; }
    static inline D dset(double x) { return x; }
    static inline D dadd(D a, D b) { return a + b; }
    static inline D dsub(D a, D b) { return a - b; }
    static inline D quotient(D a, D b, D, D) { return a / b; }
};

#if PSTAR_SIMD == 2
struct VecOps {
    typedef __m512 T;
    static constexpr int64_t W = 16;
    static inline T set(float x) { return _mm512_set1_ps(x); }
    static inline T load(const float* p) { return _mm512_loadu_ps(p); }
    static inline void store(float* p, T x) { _mm512_storeu_ps(p, x); }
    static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
    static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
    static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
    static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
    static inline T sqrt(T a) { return _mm512_sqrt_ps(a); }
    static inline T load_bf16(const uint16_t* p) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    }
    static inline T load_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static inline __m256i to_f16(T x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
    static inline __m256i to_bf16(T x) {
        const __m512i u = _mm512_castps_si512(x);
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))),
            16);
        const __mmask16 isnan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                        _mm512_set1_epi32(0x7F800000));
        r = _mm512_mask_or_epi32(r, isnan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
        return _mm512_cvtepi32_epi16(r);
    }
    static inline void store_f16(uint16_t* p, T x) { _mm256_storeu_si256((__m256i*)p, to_f16(x)); }
    static inline void store_bf16(uint16_t* p, T x) { _mm256_storeu_si256((__m256i*)p, to_bf16(x)); }
    // Non-temporal stores: the pointer must be aligned to the vector (64 B fp32, 32 B 16-bit).
    static constexpr bool kCanStream = true;
    static inline void stream(float* p, T x) { _mm512_stream_ps(p, x); }
    static inline void stream_f16(uint16_t* p, T x) { _mm256_stream_si256((__m256i*)p, to_f16(x)); }
    static inline void stream_bf16(uint16_t* p, T x) { _mm256_stream_si256((__m256i*)p, to_bf16(x)); }
    static inline void fence() { _mm_sfence(); }
    // int8 moments: a map's 256 values by code from registers — eight 32-entry permutes, then the code's top three
    // bits choose among them — where a 16-lane gather took ~36 cycles on the development VM's EPYC (and gathers are
    // slower still on Xeons with the GDS microcode fix); the same values, so the same bits
    static inline T gather(const float* table, const uint8_t* code) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)code));
        __m512 r[8];
        for (int t = 0; t < 8; ++t)
            r[t] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * t), idx, _mm512_loadu_ps(table + 32 * t + 16));
        const __mmask16 b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        const __mmask16 b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
        const __mmask16 b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
        const __m512 a0 = _mm512_mask_blend_ps(b5, r[0], r[1]), a1 = _mm512_mask_blend_ps(b5, r[2], r[3]);
        const __m512 a2 = _mm512_mask_blend_ps(b5, r[4], r[5]), a3 = _mm512_mask_blend_ps(b5, r[6], r[7]);
        return _mm512_mask_blend_ps(b7, _mm512_mask_blend_ps(b6, a0, a1), _mm512_mask_blend_ps(b6, a2, a3));
    }
    static inline void store_code(uint8_t* dst, T x, const int32_t* base, const float* cut, const uint64_t* packed) {
        const __m512i u = _mm512_castps_si512(x);
        const __m512i e = _mm512_min_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 23), _mm512_set1_epi32(0xFF)),
                                           _mm512_set1_epi32(127));
        __m512i b = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(kQ8MinExp)), 7),
                                     _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x7F)),
                                                      _mm512_set1_epi32(1)));
        b = _mm512_maskz_mov_epi32(_mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(kQ8MinExp)), b);
        b = _mm512_add_epi32(b, _mm512_and_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(kQ8BucketsPerSign)));
        // the bucket's cut and base in one 8-byte entry (`packed`, cpu_adam.cpp packed_buckets): two gathers of 8
        // instead of two of 16, then the cuts and the bases pulled apart
        const __m512i lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(b), (const long long*)packed, 8);
        const __m512i hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(b, 1), (const long long*)packed, 8);
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512 c = _mm512_castsi512_ps(_mm512_permutex2var_epi32(lo, even, hi));
        __m512i q = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
        q = _mm512_mask_add_epi32(q, _mm512_cmp_ps_mask(c, x, _CMP_LT_OQ), q, _mm512_set1_epi32(1));
        _mm_storeu_si128((__m128i*)dst, _mm512_cvtepi32_epi8(q));
    }
    static inline T abs(T a) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7FFFFFFF))); }
    static inline T max(T a, T b) { return _mm512_max_ps(a, b); }
    static inline float hmax(T a) {
        alignas(64) float f[16];
        _mm512_store_ps(f, a);
        float r = f[0];
        for (int j = 1; j < 16; ++j) r = r > f[j] ? r : f[j];
        return r;
    }
    typedef __m512d D;
    static constexpr int kHalves = 2;
    static inline D widen(T x, int h) {
        return _mm512_cvtps_pd(h == 0 ? _mm512_castps512_ps256(x) : _mm512_extractf32x8_ps(x, 1));
    }
    static inline D widen_load(const float* p, int h) { return _mm512_cvtps_pd(_mm256_loadu_ps(p + 8 * h)); }
    static inline T narrow(const D* d) {
        return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(d[0])), _mm512_cvtpd_ps(d[1]), 1);
    }
    static inline D dset(double x) { return _mm512_set1_pd(x); }
    static inline D dadd(D a, D b) { return _mm512_add_pd(a, b); }
    static inline D dsub(D a, D b) { return _mm512_sub_pd(a, b); }
    // a / b rounded to nearest from b's reciprocal split in two, inv + lo (reciprocal_quotient: see the Adam undo below)
    static inline D quotient(D a, D, D inv, D lo) { return _mm512_fmadd_pd(a, inv, _mm512_mul_pd(a, lo)); }
};
#elif PSTAR_SIMD == 1
struct VecOps {
    typedef __m256 T;
    static constexpr int64_t W = 8;
    static inline T set(float x) { return _mm256_set1_ps(x); }
    static inline T load(const float* p) { return _mm256_loadu_ps(p); }
    static inline void store(float* p, T x) { _mm256_storeu_ps(p, x); }
    static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
    static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
    static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
    static inline T div(T a, T b) { return _mm256_div_ps(a, b); }
    static inline T sqrt(T a) { return _mm256_sqrt_ps(a); }
    static inline T load_bf16(const uint16_t* p) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
    }
    static inline T load_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static inline __m128i to_f16(T x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT); }
    static inline __m128i to_bf16(T x) {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))),
            16);
        // signed compare is fine: both sides are non-negative as int32
        const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                                 _mm256_set1_epi32(0x7F800000));
        const __m256i nanv = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
        const __m256i b = _mm256_blendv_epi8(r, nanv, isnan);
        // every lane is < 2^16, so unsigned saturation is exact
        return _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    }
    static inline void store_f16(uint16_t* p, T x) { _mm_storeu_si128((__m128i*)p, to_f16(x)); }
    static inline void store_bf16(uint16_t* p, T x) { _mm_storeu_si128((__m128i*)p, to_bf16(x)); }
    // Non-temporal stores: the pointer must be aligned to the vector (32 B fp32, 16 B 16-bit).
    static constexpr bool kCanStream = true;
    static inline void stream(float* p, T x) { _mm256_stream_ps(p, x); }
    static inline void stream_f16(uint16_t* p, T x) { _mm_stream_si128((__m128i*)p, to_f16(x)); }
    static inline void stream_bf16(uint16_t* p, T x) { _mm_stream_si128((__m128i*)p, to_bf16(x)); }
    static inline void fence() { _mm_sfence(); }
    static inline T gather(const float* table, const uint8_t* code) {
        return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)code)), 4);
    }
    static inline void store_code(uint8_t* dst, T x, const int32_t* base, const float* cut, const uint64_t* packed) {
        const __m256i u = _mm256_castps_si256(x);
        const __m256i e = _mm256_min_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 23), _mm256_set1_epi32(0xFF)),
                                           _mm256_set1_epi32(127));
        __m256i b = _mm256_add_epi32(_mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(kQ8MinExp)), 7),
                                     _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x7F)),
                                                      _mm256_set1_epi32(1)));
        b = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(kQ8MinExp), e), b);   // tiny |x|: bucket 0
        b = _mm256_add_epi32(b, _mm256_and_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32(kQ8BucketsPerSign)));
        // the bucket's cut and base in one 8-byte entry: two gathers of 4 instead of two of 8
        const __m256i lo = _mm256_i32gather_epi64((const long long*)packed, _mm256_castsi256_si128(b), 8);
        const __m256i hi = _mm256_i32gather_epi64((const long long*)packed, _mm256_extracti128_si256(b, 1), 8);
        const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);      // each half: its cuts, then its bases
        const __m256i l = _mm256_permutevar8x32_epi32(lo, pick), h = _mm256_permutevar8x32_epi32(hi, pick);
        const __m256 c = _mm256_castsi256_ps(_mm256_permute2x128_si256(l, h, 0x20));
        __m256i q = _mm256_permute2x128_si256(l, h, 0x31);
        const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(c, x, _CMP_LT_OQ));
        q = _mm256_sub_epi32(q, below);                                                    // below: -1 or 0
        // 8 codes in [0, 255]: unsigned saturation is exact
        const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        _mm_storel_epi64((__m128i*)dst, _mm_packus_epi16(w, w));
    }
    static inline T abs(T a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
    static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
    static inline float hmax(T a) {
        alignas(32) float f[8];
        _mm256_store_ps(f, a);
        float r = f[0];
        for (int j = 1; j < 8; ++j) r = r > f[j] ? r : f[j];
        return r;
    }
    typedef __m256d D;
    static constexpr int kHalves = 2;
    static inline D widen(T x, int h) {
        return _mm256_cvtps_pd(h == 0 ? _mm256_castps256_ps128(x) : _mm256_extractf128_ps(x, 1));
    }
    static inline D widen_load(const float* p, int h) { return _mm256_cvtps_pd(_mm_loadu_ps(p + 4 * h)); }
    static inline T narrow(const D* d) {
        return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm256_cvtpd_ps(d[0])), _mm256_cvtpd_ps(d[1]), 1);
    }
    static inline D dset(double x) { return _mm256_set1_pd(x); }
    static inline D dadd(D a, D b) { return _mm256_add_pd(a, b); }
    static inline D dsub(D a, D b) { return _mm256_sub_pd(a, b); }
    static inline D quotient(D a, D, D inv, D lo) { return _mm256_fmadd_pd(a, inv, _mm256_mul_pd(a, lo)); }
};
#else
typedef ScalarOps VecOps;
#endif

// ---------------------------------------------------------------- Adam

// AdamCoeffs is defined once in cpu_adam.cpp, outside the per-level namespaces.

// The coefficients broadcast once per range (held in registers, not re-read from `AdamCoeffs`
// after every store, which the compiler would have to do since a float* store may alias it).
template <class O>
struct AdamConsts {
    typename O::T l2_wd, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, step_size, eps,
        grad_scale, inv_grad_scale;
    bool copy_only;   // the 16-bit copy alone (AdamCoeffs::copy_only): a loop-invariant branch the compiler unswitches
    explicit AdamConsts(const AdamCoeffs& c)
        : l2_wd(O::set(c.l2_wd)), decay(O::set(c.decay)), beta1(O::set(c.beta1)),
          one_minus_beta1(O::set(c.one_minus_beta1)), beta2(O::set(c.beta2)),
          one_minus_beta2(O::set(c.one_minus_beta2)), inv_bc2_sqrt(O::set(c.inv_bc2_sqrt)),
          step_size(O::set(c.step_size)), eps(O::set(c.eps)), grad_scale(O::set(c.grad_scale)),
          inv_grad_scale(O::set(c.scale_mode == 0 ? 1.0f : c.inv_grad_scale)), copy_only(c.copy_only) {}
};

// W consecutive elements of one step (W = 1 for the scalar ops), in the order torch.optim.AdamW
// (non-fused) applies it:
//   g = grad / grad_scale
//   AdamW: p *= 1 - lr*wd          Adam (L2): g += wd*p
//   m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*g*g
//   p -= lr/(1-b1^t) * (m / (sqrt(v) * (1/sqrt(1-b2^t)) + eps))
// torch divides by sqrt(1-b2^t); multiplying by its reciprocal saves one of the two divisions,
// which bound the step on CPUs with a slow divider, and moves denom by at most 1 ulp.
// grad_scale: multiplied by its reciprocal when that is exact (a power of two, or 1), else divided.
// GK / OK: grad / output dtype, 0 fp32, 1 bf16, 2 fp16; OK = -1: no 16-bit copy.
// ST (stores): 0 plain; 1 non-temporal for the 16-bit copy (the one array not read first, so a plain
// store would read its line before writing it: 2 B/element of extra traffic), which needs the
// vector-aligned pointer adam_range_t arranges. p, m, v keep plain stores: their lines are in cache
// from the loads (non-temporal ones there were measured slower; see cpu_adam.cpp).
// M: the moments' type. float, or bf16 bits (Config optimizer_state="bf16"): read from bf16 (exact), the step computed
// in fp32 in the same order, written back rounded to nearest even (as torch's .to(torch.bfloat16)); 24 B/element with
// fp32 grads, + 2 B for the 16-bit copy.
template <class O> static inline typename O::T load_moment(const float* x) { return O::load(x); }
template <class O> static inline typename O::T load_moment(const uint16_t* x) { return O::load_bf16(x); }
template <class O> static inline void store_moment(float* x, typename O::T y) { O::store(x, y); }
template <class O> static inline void store_moment(uint16_t* x, typename O::T y) { O::store_bf16(x, y); }

template <class O, int GK, int OK, bool kDivScale, bool kDecoupled, int ST, class M>
static inline void adam_elems(float* p, const void* grad, M* m, M* v, void* out, int64_t i, const AdamConsts<O>& k) {
    typedef typename O::T T;
    T g = GK == 0 ? O::load(static_cast<const float*>(grad) + i)
        : GK == 1 ? O::load_bf16(static_cast<const uint16_t*>(grad) + i)
                  : O::load_f16(static_cast<const uint16_t*>(grad) + i);
    g = kDivScale ? O::div(g, k.grad_scale) : O::mul(g, k.inv_grad_scale);
    T pi = O::load(p + i);
    if (kDecoupled) pi = O::mul(pi, k.decay);
    else g = O::add(g, O::mul(k.l2_wd, pi));
    const T mi = O::add(O::mul(k.beta1, load_moment<O>(m + i)), O::mul(k.one_minus_beta1, g));
    const T vi = O::add(O::mul(k.beta2, load_moment<O>(v + i)), O::mul(O::mul(k.one_minus_beta2, g), g));
    const T denom = O::add(O::mul(O::sqrt(vi), k.inv_bc2_sqrt), k.eps);
    pi = O::sub(pi, O::mul(k.step_size, O::div(mi, denom)));
    if (!k.copy_only) {
        O::store(p + i, pi);
        store_moment<O>(m + i, mi);
        store_moment<O>(v + i, vi);
    }
    if (OK == 1) ST ? O::stream_bf16(static_cast<uint16_t*>(out) + i, pi) : O::store_bf16(static_cast<uint16_t*>(out) + i, pi);
    else if (OK == 2) ST ? O::stream_f16(static_cast<uint16_t*>(out) + i, pi) : O::store_f16(static_cast<uint16_t*>(out) + i, pi);
}

static inline bool aligned_to(const void* ptr, int64_t bytes) { return (uintptr_t)ptr % (uintptr_t)bytes == 0; }

// One thread's contiguous range [0, n) of a chunk; pointers already offset to the range start. bf16 moments run it
// too (they had plain stores and no prefetch until session 20: on the H200 box they moved 146 GB/s against fp32's 176;
// on the development VM this range took them from 2.35 to 2.73 G params/s on one thread, the same bits).
template <int GK, int OK, bool kDivScale, bool kDecoupled, int ST, class M>
static void adam_range_t(float* p, const void* grad, M* m, M* v, void* out, int64_t n, const AdamCoeffs& c) {
    const AdamConsts<VecOps> kv(c);
    const AdamConsts<ScalarOps> ks(c);
    int64_t i = 0;
    if (ST != 0)  // scalar head up to the first element whose 16-bit copy is vector-aligned
        for (; i < n && !aligned_to(static_cast<uint16_t*>(out) + i, VecOps::W * 2); ++i)
            adam_elems<ScalarOps, GK, OK, kDivScale, kDecoupled, 0>(p, grad, m, v, out, i, ks);
#if PSTAR_SIMD != 0
    if (c.prefetch_elems != 0) {
        // Software prefetch, prefetch_elems ahead: one per 64-byte line of each array read. The hardware
        // prefetcher stops at every 4 KiB page edge and restarts only after misses on the next page; these
        // carry each stream across. Addresses are integers: a prefetch past the end is harmless, and never
        // faults.
        const uintptr_t ahead = (uintptr_t)(c.prefetch_elems > 0 ? c.prefetch_elems : -c.prefetch_elems);
        const uintptr_t gsize = GK == 0 ? 4 : 2;
        const uintptr_t msize = sizeof(M);
        const int64_t per_line = 16 / VecOps::W;  // vectors per 64 B line of fp32: 1 (AVX-512) or 2 (AVX2)
        const bool to_l1 = c.prefetch_elems > 0;
        for (int64_t it = 0; i + VecOps::W <= n; i += VecOps::W, ++it) {
            if (it % per_line == 0) {
                const uintptr_t j = (uintptr_t)i + ahead;
                const char* pp = (const char*)((uintptr_t)p + 4 * j);
                const char* mp = (const char*)((uintptr_t)m + msize * j);
                const char* vp = (const char*)((uintptr_t)v + msize * j);
                const char* gp = (const char*)((uintptr_t)grad + gsize * j);
                const bool even = (it / per_line) % 2 == 0;   // a 16-bit array's line spans 2 fp32 lines
                const bool mline = msize == 4 || even, gline = gsize == 4 || even;
                if (to_l1) {
                    _mm_prefetch(pp, _MM_HINT_T0);
                    if (mline) _mm_prefetch(mp, _MM_HINT_T0), _mm_prefetch(vp, _MM_HINT_T0);
                    if (gline) _mm_prefetch(gp, _MM_HINT_T0);
                } else {
                    _mm_prefetch(pp, _MM_HINT_T1);
                    if (mline) _mm_prefetch(mp, _MM_HINT_T1), _mm_prefetch(vp, _MM_HINT_T1);
                    if (gline) _mm_prefetch(gp, _MM_HINT_T1);
                }
            }
            adam_elems<VecOps, GK, OK, kDivScale, kDecoupled, ST>(p, grad, m, v, out, i, kv);
        }
    }
#endif
    for (; i + VecOps::W <= n; i += VecOps::W)
        adam_elems<VecOps, GK, OK, kDivScale, kDecoupled, ST>(p, grad, m, v, out, i, kv);
    // tail: bit-identical to the vector lanes (IEEE ops in the same order, no FMA)
    for (; i < n; ++i) adam_elems<ScalarOps, GK, OK, kDivScale, kDecoupled, 0>(p, grad, m, v, out, i, ks);
    if (ST != 0) VecOps::fence();  // order the write-combined lines before the caller's barrier
}

template <int GK, int OK, bool kDivScale, bool kDecoupled, class M>
static void adam_range_s(float* p, const void* grad, M* m, M* v, void* out, int64_t n, const AdamCoeffs& c) {
    // a 16-bit pointer reaches vector alignment within W elements; short ranges are not worth the head
    if constexpr (OK >= 1 && VecOps::kCanStream) {
        if (c.stores == 1 && n >= 4 * VecOps::W) return adam_range_t<GK, OK, kDivScale, kDecoupled, 1>(p, grad, m, v, out, n, c);
    }
    adam_range_t<GK, OK, kDivScale, kDecoupled, 0>(p, grad, m, v, out, n, c);
}

// The same step with int8 moments (Config optimizer_state="int8", kernels/quant8.py): per block of kQ8Block
// elements, each moment is dequantized (map[code] * the block's absmax), the step computed in fp32 in
// adam_elems' order, the master written from the unquantized new moments, and these kept in a block buffer
// with their largest |value|; then the block is quantized against that absmax (x = value / absmax, IEEE
// division; the code is how many thresholds lie below x, from its bucket: store_code) and the absmax stored as
// its scale. (An 8-step binary search over the thresholds, gathered, ran at 1/17 of the fp32 Adam's speed on the
// development VM's AMD EPYC: eight dependent gathers per vector; the bucket takes two independent ones.) The gathers
// bound it: on one thread of that VM it ran at 0.39 G params/s against 2.44 for fp32 moments, 0.84 without the
// maps' gathers and 0.82 without the buckets'. The AVX-512 level reads the maps from registers and gathers each
// bucket's base and cut as one 8-byte entry: 0.76 G params/s, the same bits (1.9x on 1 and 2 threads,
// tests/test_int8_state.py; bench/RESULTS.md, session 20). The AVX2 level gathers the buckets so too (~1.2x there);
// its maps stay gathered (eight-entry permutes would take 32 for a map).
// Bytes per element: read p 4, m and v codes 2, grad 4 (2); write p 4, codes 2; + 16 B of scales per block:
// 16 B with fp32 grads (12 B less than fp32 moments), + 2 B for the 16-bit copy. Plain stores only.
template <class O, int GK, int OK, bool kDivScale, bool kDecoupled>
static inline void adam_elems_q8(float* p, const void* grad, const uint8_t* mc, const uint8_t* vc, void* out,
                                 int64_t i, typename O::T mscale, typename O::T vscale, float* mnew, float* vnew,
                                 typename O::T& mmax, typename O::T& vmax, const AdamConsts<O>& k,
                                 const AdamCoeffs& c) {
    typedef typename O::T T;
    T g = GK == 0 ? O::load(static_cast<const float*>(grad) + i)
        : GK == 1 ? O::load_bf16(static_cast<const uint16_t*>(grad) + i)
                  : O::load_f16(static_cast<const uint16_t*>(grad) + i);
    g = kDivScale ? O::div(g, k.grad_scale) : O::mul(g, k.inv_grad_scale);
    T pi = O::load(p + i);
    if (kDecoupled) pi = O::mul(pi, k.decay);
    else g = O::add(g, O::mul(k.l2_wd, pi));
    const T m0 = O::mul(O::gather(c.q8_signed_map, mc + i), mscale);
    const T v0 = O::mul(O::gather(c.q8_unsigned_map, vc + i), vscale);
    const T mi = O::add(O::mul(k.beta1, m0), O::mul(k.one_minus_beta1, g));
    const T vi = O::add(O::mul(k.beta2, v0), O::mul(O::mul(k.one_minus_beta2, g), g));
    const T denom = O::add(O::mul(O::sqrt(vi), k.inv_bc2_sqrt), k.eps);
    pi = O::sub(pi, O::mul(k.step_size, O::div(mi, denom)));
    O::store(p + i, pi);
    O::store(mnew, mi);
    O::store(vnew, vi);
    mmax = O::max(mmax, O::abs(mi));
    vmax = O::max(vmax, O::abs(vi));
    if (OK == 1) O::store_bf16(static_cast<uint16_t*>(out) + i, pi);
    else if (OK == 2) O::store_f16(static_cast<uint16_t*>(out) + i, pi);
}

// One block's new values -> codes, against its absmax (an all-zero block divides by 1: its codes are 0's)
static inline void quantize_block(const float* x, int64_t len, float absmax, const int32_t* base, const float* cut,
                                  const uint64_t* packed, uint8_t* codes) {
    const float d = absmax > 0.0f ? absmax : 1.0f;
    const VecOps::T dv = VecOps::set(d);
    int64_t j = 0;
    for (; j + VecOps::W <= len; j += VecOps::W)
        VecOps::store_code(codes + j, VecOps::div(VecOps::load(x + j), dv), base, cut, packed);
    for (; j < len; ++j) ScalarOps::store_code(codes + j, x[j] / d, base, cut, packed);
}

template <int GK, int OK, bool kDivScale, bool kDecoupled>
static void adam_q8_t(float* p, const void* grad, Q8* m, Q8* v, void* out, int64_t n, const AdamCoeffs& c) {
    const AdamConsts<VecOps> kv(c);
    const AdamConsts<ScalarOps> ks(c);
    alignas(64) float mb[kQ8Block], vb[kQ8Block];
    for (int64_t b0 = 0, blk = 0; b0 < n; b0 += kQ8Block, ++blk) {
        const int64_t len = n - b0 < kQ8Block ? n - b0 : kQ8Block;
        const float ms = m->absmax[blk], vs = v->absmax[blk];
        const VecOps::T msv = VecOps::set(ms), vsv = VecOps::set(vs);
        VecOps::T mmaxv = VecOps::set(0.0f), vmaxv = VecOps::set(0.0f);
        int64_t j = 0;
        for (; j + VecOps::W <= len; j += VecOps::W)
            adam_elems_q8<VecOps, GK, OK, kDivScale, kDecoupled>(p, grad, m->codes, v->codes, out, b0 + j, msv, vsv,
                                                                 mb + j, vb + j, mmaxv, vmaxv, kv, c);
        float mmax = VecOps::hmax(mmaxv), vmax = VecOps::hmax(vmaxv);
        for (; j < len; ++j)
            adam_elems_q8<ScalarOps, GK, OK, kDivScale, kDecoupled>(p, grad, m->codes, v->codes, out, b0 + j, ms, vs,
                                                                    mb + j, vb + j, mmax, vmax, ks, c);
        quantize_block(mb, len, mmax, c.q8_signed_base, c.q8_signed_cut, c.q8_signed_packed, m->codes + b0);
        quantize_block(vb, len, vmax, c.q8_unsigned_base, c.q8_unsigned_cut, c.q8_unsigned_packed, v->codes + b0);
        m->absmax[blk] = mmax;
        v->absmax[blk] = vmax;
    }
}

// The kernel for the moments' type: fp32 or bf16 (adam_range_s), or int8 (adam_q8_t)
template <int GK, int OK, bool kDivScale, bool kDecoupled>
static void adam_kernel(float* p, const void* grad, float* m, float* v, void* out, int64_t n, const AdamCoeffs& c) {
    adam_range_s<GK, OK, kDivScale, kDecoupled>(p, grad, m, v, out, n, c);
}

template <int GK, int OK, bool kDivScale, bool kDecoupled>
static void adam_kernel(float* p, const void* grad, Q8* m, Q8* v, void* out, int64_t n, const AdamCoeffs& c) {
    adam_q8_t<GK, OK, kDivScale, kDecoupled>(p, grad, m, v, out, n, c);
}

template <int GK, int OK, bool kDivScale, bool kDecoupled>
static void adam_kernel(float* p, const void* grad, uint16_t* m, uint16_t* v, void* out, int64_t n,
                        const AdamCoeffs& c) {
    adam_range_s<GK, OK, kDivScale, kDecoupled>(p, grad, m, v, out, n, c);
}

// The runtime flags (grad dtype, 16-bit copy, scale mode, weight decay) -> the kernel's template arguments,
// for each moment type M (float, bf16 bits, or Q8: int8 codes with their scales)
template <int GK, int OK, class M>
static void adam_range_o(float* p, const void* grad, M* m, M* v, void* out, int64_t n, const AdamCoeffs& c) {
    const bool div = c.scale_mode == 2;
    if (c.decoupled) div ? adam_kernel<GK, OK, true, true>(p, grad, m, v, out, n, c)
                         : adam_kernel<GK, OK, false, true>(p, grad, m, v, out, n, c);
    else div ? adam_kernel<GK, OK, true, false>(p, grad, m, v, out, n, c)
             : adam_kernel<GK, OK, false, false>(p, grad, m, v, out, n, c);
}

template <int GK, class M>
static void adam_range_g(float* p, const void* grad, M* m, M* v, void* out, int out_dtype, int64_t n,
                         const AdamCoeffs& c) {
    if (out == nullptr) adam_range_o<GK, -1>(p, grad, m, v, out, n, c);
    else if (out_dtype == 1) adam_range_o<GK, 1>(p, grad, m, v, out, n, c);
    else adam_range_o<GK, 2>(p, grad, m, v, out, n, c);
}

template <class M>
static void adam_range(float* p, const void* grad, int grad_dtype, M* m, M* v,
                       void* out, int out_dtype, int64_t n, const AdamCoeffs& c) {
    if (grad_dtype == 0) adam_range_g<0>(p, grad, m, v, out, out_dtype, n, c);
    else if (grad_dtype == 1) adam_range_g<1>(p, grad, m, v, out, out_dtype, n, c);
    else adam_range_g<2>(p, grad, m, v, out, out_dtype, n, c);
}

// ---------------------------------------------------------------- Adam undo (and redo)

// The inverse of adam_elems, given the state after a step and the grad it consumed (see adam_undo in
// cpu_adam.cpp for the contract), and with REDO the step again with grad / redo_scale. The arithmetic is the
// old scalar kernel's, operation for operation, so every level gives its bits:
//   u  = step_size * (m1 / (sqrt(v1) * inv_bc2_sqrt + eps))         fp32, adam_elems' ops: the step's own u
//   p0 = (float)(((double)p1 + (double)u) / decay)                   AdamW (L2: no quotient)
//   g  = grad / grad_scale  (+ wd * p0 for L2)                       fp32
//   m0 = (float)(((double)m1 - (double)((1 - b1) * g)) / b1)        0 after step 1
//   v0 = (float)(((double)v1 - (double)((1 - b2) * g * g)) / b2), a NaN or a value <= 0 as +0
// then, with REDO, adam_elems from (p0, m0, v0) with grad / redo_scale.
// The double sums of two floats and the conversions are single vector instructions. The three quotients by a
// constant were the old kernel's cost (a vdivpd is ~16 cycles per 8 doubles on Xeons, three per element). The
// vector levels compute them from b's reciprocal split in two doubles, inv = RD(1/b) and lo = RN((1 - inv*b)/b)
// >= 0 (UndoCoeffs, cpu_adam.cpp), as one multiply and one FMA:
//   q = RN(a * inv + RN(a * lo))       reciprocal_quotient
// and q is a / b rounded to nearest, the IEEE division's result, for every double a:
//  - the argument is within 2^-103 |a/b| of a/b: inv + lo is 1/b to 2^-104 relative, and RN(a * lo) is off by at
//    most 2^-53 of a * lo < 2^-51 a/b;
//  - a/b is never that close to a midpoint between two doubles, the only places where rounding a nearby value
//    can differ: with a = A 2^ea (A < 2^53), b = B 2^eb (B < 2^24 odd, b an fp32) and a midpoint
//    m = M 2^em (M odd, 54 bits), a - b m is a nonzero multiple of 2^min(ea, eb + em) (B M is odd with 54 bits or
//    more, so it is no A 2^k), hence |a/b - m| > 2^-77 |a/b|.
// So the argument and a/b round to the same double: the margin is 2^26-fold. It needs b > 0 finite and no
// underflow: |a| >= 2^-150 or a = 0 (a is a double sum of fp32 values) keeps a * lo above 2^-400. A zero a
// keeps its sign (lo >= 0: -0 * lo + -0 * inv is -0); an infinite a stays infinite while lo > 0, so b must
// be no power of two (there lo = 0 and inf * 0 is NaN). adam_undo runs the scalar level, whose quotients are
// divisions, when a divisor breaks these (b1 = 0.5, an AdamW decay 1 - lr*wd <= 0); a decay of 1 (no weight
// decay) divides nothing. Checked against the division for 2.4e8 quotients over 61 divisors: no difference.
//
// Bytes per element: read p, m, v 12 B + grad 4 B (fp32) / 2 B (16-bit), write p, m, v 12 B: 28 / 26 B;
// with REDO the same + 2 B for the 16-bit copy (non-temporal with ST, as the Adam's); part 1 (the master
// only) reads p, m, v and writes p: 16 B. A correction with bf16 grads and copy moves 28 B, as the Adam does.
// Its arithmetic does not fit in the Adam's time from cache: it needs two vdivps + vsqrtps pairs per vector (the
// step's update term, recomputed bit for bit, then the new step's), where the Adam needs one (and is bound by it
// in cache, ~22 cycles per 16 lanes), plus ~60 port-0/5 uops on float64 halves (18 fp32 <-> fp64 conversions, 6
// sums, 3 quotients of 2 ops each per half). One core in cache (the 2-core AVX-512 VM): 0.66-0.71 G elem/s
// against the Adam's 1.8-1.9 and the scalar level's (the old kernel) 0.13. It keeps up with the Adam where memory
// binds the Adam below ~0.6 G elem/s a core (bench/host_undo_bench.py).

template <class O>
struct UndoConsts {
    typename O::T decay, l2_wd, b1, omb1, b2, omb2, inv_bc2_sqrt, step_size, eps, inv_scale, scale, inv_redo,
        redo_scale, zero;
    typename O::D decay_d, decay_inv, decay_lo, b1_d, b1_inv, b1_lo, b2_d, b2_inv, b2_lo;
    bool decoupled, divide_master, first, has_m, has_v, div_scale, div_redo;
    explicit UndoConsts(const UndoCoeffs& c)
        : decay(O::set(c.decay)), l2_wd(O::set(c.l2_wd)), b1(O::set(c.b1)), omb1(O::set(c.omb1)), b2(O::set(c.b2)),
          omb2(O::set(c.omb2)), inv_bc2_sqrt(O::set(c.inv_bc2_sqrt)), step_size(O::set(c.step_size)),
          eps(O::set(c.eps)), inv_scale(O::set(c.inv_scale)), scale(O::set(c.scale)), inv_redo(O::set(c.inv_redo)),
          redo_scale(O::set(c.redo_scale)), zero(O::set(0.0f)), decay_d(O::dset((double)c.decay)),
          decay_inv(O::dset(c.recip[0][0])), decay_lo(O::dset(c.recip[0][1])), b1_d(O::dset((double)c.b1)),
          b1_inv(O::dset(c.recip[1][0])), b1_lo(O::dset(c.recip[1][1])), b2_d(O::dset((double)c.b2)),
          b2_inv(O::dset(c.recip[2][0])), b2_lo(O::dset(c.recip[2][1])), decoupled(c.decoupled),
          divide_master(c.master_quotient), first(c.first),
          has_m(c.b1 > 0.0f), has_v(c.b2 > 0.0f), div_scale(c.div_scale), div_redo(c.div_redo) {}
};

// (float)(((double)p1 + (double)u) / decay), the quotient only for AdamW (and not by 1: x / 1 is x)
// (the updated values x1 are widened from memory: a load does the lane split, not a shuffle)
template <class O>
static inline typename O::T undo_master(const float* p1, typename O::T u, const UndoConsts<O>& k) {
    typename O::D h[O::kHalves];
    for (int j = 0; j < O::kHalves; ++j) {
        const typename O::D s = O::dadd(O::widen_load(p1, j), O::widen(u, j));
        h[j] = k.divide_master ? O::quotient(s, k.decay_d, k.decay_inv, k.decay_lo) : s;
    }
    return O::narrow(h);
}

// (float)(((double)x1 - (double)t) / b)
template <class O>
static inline typename O::T undo_moment(const float* x1, typename O::T t, typename O::D b, typename O::D inv,
                                        typename O::D lo) {
    typename O::D h[O::kHalves];
    for (int j = 0; j < O::kHalves; ++j) h[j] = O::quotient(O::dsub(O::widen_load(x1, j), O::widen(t, j)), b, inv, lo);
    return O::narrow(h);
}

// grad / scale: multiplied by the reciprocal when that is exact (a power of two, or 1), as adam_elems does
template <class O>
static inline typename O::T unscaled(typename O::T g, bool div, typename O::T scale, typename O::T inv) {
    return div ? O::div(g, scale) : O::mul(g, inv);
}

// A correction in one fp32 pass (PART 4, and 5 for its 16-bit copy alone): the step taken with gs = grad / grad_scale
// made again with gr = grad / redo_scale, from the updated state alone, no undo and no float64:
//   u1 = step_size * (m1 / (sqrt(v1) * inv_bc2_sqrt + eps))       the speculated step's own term, as adam_elems
//   (L2: gs, gr += wd * (p1 + u1), the master before the step)
//   m2 = (m1 - (1 - b1) * gs) + (1 - b1) * gr                     b1 * m0 from m1, then the new grad's share
//   v2 = max(v1 - (1 - b2) * gs * gs, 0) + (1 - b2) * gr * gr
//   (step 1: m2, v2 as adam_elems makes them from zeros)
//   u2 = step_size * (m2 / (sqrt(v2) * inv_bc2_sqrt + eps))
//   p2 = p1 + (u1 - u2)                                            p1 + u1 is the decayed master before the step
// Two divide + sqrt pairs per vector and ~14 fp32 ops, against the undo-then-redo's two pairs plus ~60 float64
// uops: arithmetic a core does at several times the memory's pace. What changes against undo-then-redo: p2 carries
// p1's rounding once more (within two ulps of the larger of the master and the update term of the step made afresh,
// plus what the moments' rounding moves that term by: tests/test_kernels.py); m2 and v2 carry m1's and v1's
// rounding as an absolute error (the undo's m0 did the same, divided by b1). p, m, v are read
// once and written once (28 B with bf16 grads and the copy); PART 5 writes only the copy (16 B).
template <class O, int GK, int OK, bool COPY_ONLY, int ST>
static inline void rescale_elems(float* p, const void* grad, float* m, float* v, uint16_t* out, int64_t i,
                                 const UndoConsts<O>& k) {
    typedef typename O::T T;
    const T m1 = O::load(m + i), v1 = O::load(v + i), p1 = O::load(p + i);
    const T graw = GK == 0 ? O::load(static_cast<const float*>(grad) + i)
                 : GK == 1 ? O::load_bf16(static_cast<const uint16_t*>(grad) + i)
                           : O::load_f16(static_cast<const uint16_t*>(grad) + i);
    T gs = unscaled<O>(graw, k.div_scale, k.scale, k.inv_scale);
    T gr = unscaled<O>(graw, k.div_redo, k.redo_scale, k.inv_redo);
    const T u1 = O::mul(k.step_size, O::div(m1, O::add(O::mul(O::sqrt(v1), k.inv_bc2_sqrt), k.eps)));
    if (!k.decoupled) {
        const T wp = O::mul(k.l2_wd, O::add(p1, u1));
        gs = O::add(gs, wp);
        gr = O::add(gr, wp);
    }
    T m2, v2;
    if (k.first) {
        m2 = O::add(O::mul(k.b1, k.zero), O::mul(k.omb1, gr));
        v2 = O::add(O::mul(k.b2, k.zero), O::mul(O::mul(k.omb2, gr), gr));
    } else {
        m2 = O::add(O::sub(m1, O::mul(k.omb1, gs)), O::mul(k.omb1, gr));
        // b2 * v0 >= 0 before the new grad's share is added, as the undo's restored v0 is: v2 never falls below
        // (1 - b2) gr^2 where v1's rounding swamps b2 * v0 (a tiny v0 beside a large guessed gradient)
        v2 = O::add(O::max(O::sub(v1, O::mul(O::mul(k.omb2, gs), gs)), k.zero), O::mul(O::mul(k.omb2, gr), gr));
    }
    const T u2 = O::mul(k.step_size, O::div(m2, O::add(O::mul(O::sqrt(v2), k.inv_bc2_sqrt), k.eps)));
    const T p2 = O::add(p1, O::sub(u1, u2));
    if (!COPY_ONLY) {
        O::store(p + i, p2);
        O::store(m + i, m2);
        O::store(v + i, v2);
    }
    if (OK == 1) ST ? O::stream_bf16(out + i, p2) : O::store_bf16(out + i, p2);
    else if (OK == 2) ST ? O::stream_f16(out + i, p2) : O::store_f16(out + i, p2);
}

// W consecutive elements. PART: 0 everything, 1 the master only (no grad), 2 the moments (the master restored),
// 3 a correction's 16-bit copy only (computed as PART 0 computes it; p, m, v are read and left as they are);
// 4 and 5: the one-pass fp32 correction and its copy alone (rescale_elems).
template <class O, int GK, int OK, bool REDO, int PART, int ST>
static inline void undo_elems(float* p, const void* grad, float* m, float* v, uint16_t* out, int64_t i,
                              const UndoConsts<O>& k) {
    if constexpr (PART >= 4) return rescale_elems<O, GK, OK, PART == 5, ST>(p, grad, m, v, out, i, k);
    typedef typename O::T T;
    const T m1 = O::load(m + i), v1 = O::load(v + i);
    T p0 = O::load(p + i);
    if (PART != 2) {
        const T denom = O::add(O::mul(O::sqrt(v1), k.inv_bc2_sqrt), k.eps);
        p0 = undo_master<O>(p + i, O::mul(k.step_size, O::div(m1, denom)), k);
    }
    if (PART == 1) {
        O::store(p + i, p0);
        return;
    }
    const T graw = GK == 0 ? O::load(static_cast<const float*>(grad) + i)
                 : GK == 1 ? O::load_bf16(static_cast<const uint16_t*>(grad) + i)
                           : O::load_f16(static_cast<const uint16_t*>(grad) + i);
    T g = unscaled<O>(graw, k.div_scale, k.scale, k.inv_scale);
    if (!k.decoupled) g = O::add(g, O::mul(k.l2_wd, p0));
    T m0 = k.zero, v0 = k.zero;
    if (!k.first) {
        if (k.has_m) m0 = undo_moment<O>(m + i, O::mul(k.omb1, g), k.b1_d, k.b1_inv, k.b1_lo);
        // the old kernel's vv > 0 ? (float)vv : 0, as max((float)vv, +0): (float) keeps the sign and NaN-ness
        // of vv (a positive vv may round to +0), and max(x, +0) gives +0 for NaN and -0 (maxps' rule)
        if (k.has_v) v0 = O::max(undo_moment<O>(v + i, O::mul(O::mul(k.omb2, g), g), k.b2_d, k.b2_inv, k.b2_lo), k.zero);
    }
    if (REDO) {  // adam_elems, from the restored state
        T gr = unscaled<O>(graw, k.div_redo, k.redo_scale, k.inv_redo);
        if (k.decoupled) p0 = O::mul(p0, k.decay);
        else gr = O::add(gr, O::mul(k.l2_wd, p0));
        m0 = O::add(O::mul(k.b1, m0), O::mul(k.omb1, gr));
        v0 = O::add(O::mul(k.b2, v0), O::mul(O::mul(k.omb2, gr), gr));
        const T denom = O::add(O::mul(O::sqrt(v0), k.inv_bc2_sqrt), k.eps);
        p0 = O::sub(p0, O::mul(k.step_size, O::div(m0, denom)));
    }
    if (PART != 3) {
        O::store(p + i, p0);
        O::store(m + i, m0);
        O::store(v + i, v0);
    }
    if (REDO && OK == 1) ST ? O::stream_bf16(out + i, p0) : O::store_bf16(out + i, p0);
    else if (REDO && OK == 2) ST ? O::stream_f16(out + i, p0) : O::store_f16(out + i, p0);
}

// One block [0, n) of a chunk, pointers offset to its start; the head, prefetch and stores as adam_range_t's.
template <int GK, int OK, bool REDO, int PART, int ST>
static void undo_range_t(float* p, const void* grad, float* m, float* v, uint16_t* out, int64_t n,
                         const UndoCoeffs& c) {
    const UndoConsts<VecOps> kv(c);
    const UndoConsts<ScalarOps> ks(c);
    int64_t i = 0;
    if (ST != 0)
        for (; i < n && !aligned_to(out + i, VecOps::W * 2); ++i)
            undo_elems<ScalarOps, GK, OK, REDO, PART, 0>(p, grad, m, v, out, i, ks);
#if PSTAR_SIMD != 0
    if (c.prefetch_elems != 0) {
        const uintptr_t ahead = (uintptr_t)(c.prefetch_elems > 0 ? c.prefetch_elems : -c.prefetch_elems);
        const uintptr_t gsize = GK == 0 ? 4 : 2;
        const int64_t per_line = 16 / VecOps::W;
        const int hint = c.prefetch_elems > 0 ? _MM_HINT_T0 : _MM_HINT_T1;
        for (int64_t it = 0; i + VecOps::W <= n; i += VecOps::W, ++it) {
            if (it % per_line == 0) {
                const uintptr_t j = (uintptr_t)i + ahead;
                const char* lines[4] = {(const char*)((uintptr_t)p + 4 * j), (const char*)((uintptr_t)m + 4 * j),
                                        (const char*)((uintptr_t)v + 4 * j), (const char*)((uintptr_t)grad + gsize * j)};
                const int count = PART == 1 || (gsize == 2 && (it / per_line) % 2 != 0) ? 3 : 4;
                if (hint == _MM_HINT_T0) for (int l = 0; l < count; ++l) _mm_prefetch(lines[l], _MM_HINT_T0);
                else for (int l = 0; l < count; ++l) _mm_prefetch(lines[l], _MM_HINT_T1);
            }
            undo_elems<VecOps, GK, OK, REDO, PART, ST>(p, grad, m, v, out, i, kv);
        }
    }
#endif
    for (; i + VecOps::W <= n; i += VecOps::W) undo_elems<VecOps, GK, OK, REDO, PART, ST>(p, grad, m, v, out, i, kv);
    for (; i < n; ++i) undo_elems<ScalarOps, GK, OK, REDO, PART, 0>(p, grad, m, v, out, i, ks);
    if (ST != 0) VecOps::fence();
}

template <int GK, int OK, bool REDO, int PART>
static void undo_range_s(float* p, const void* grad, float* m, float* v, uint16_t* out, int64_t n,
                         const UndoCoeffs& c) {
    if constexpr (REDO && OK >= 1 && VecOps::kCanStream) {
        if (c.stores == 1 && n >= 4 * VecOps::W) return undo_range_t<GK, OK, REDO, PART, 1>(p, grad, m, v, out, n, c);
    }
    undo_range_t<GK, OK, REDO, PART, 0>(p, grad, m, v, out, n, c);
}

template <int GK>
static void undo_range_g(float* p, const void* grad, float* m, float* v, uint16_t* out, int out_dtype, int64_t n,
                         const UndoCoeffs& c, int part, bool redo) {
    if (part >= 4) {  // the one-pass correction (always a redo; part 5 needs the copy)
        if (out == nullptr) return undo_range_s<GK, -1, true, 4>(p, grad, m, v, out, n, c);
        if (out_dtype == 1) return part == 5 ? undo_range_s<GK, 1, true, 5>(p, grad, m, v, out, n, c)
                                             : undo_range_s<GK, 1, true, 4>(p, grad, m, v, out, n, c);
        return part == 5 ? undo_range_s<GK, 2, true, 5>(p, grad, m, v, out, n, c)
                         : undo_range_s<GK, 2, true, 4>(p, grad, m, v, out, n, c);
    }
    if (!redo) return part == 2 ? undo_range_s<GK, -1, false, 2>(p, grad, m, v, out, n, c)
                                : undo_range_s<GK, -1, false, 0>(p, grad, m, v, out, n, c);
    if (out == nullptr) return part == 2 ? undo_range_s<GK, -1, true, 2>(p, grad, m, v, out, n, c)
                                         : undo_range_s<GK, -1, true, 0>(p, grad, m, v, out, n, c);
    if (out_dtype == 1) return part == 2 ? undo_range_s<GK, 1, true, 2>(p, grad, m, v, out, n, c)
                             : part == 3 ? undo_range_s<GK, 1, true, 3>(p, grad, m, v, out, n, c)
                                         : undo_range_s<GK, 1, true, 0>(p, grad, m, v, out, n, c);
    return part == 2 ? undo_range_s<GK, 2, true, 2>(p, grad, m, v, out, n, c)
         : part == 3 ? undo_range_s<GK, 2, true, 3>(p, grad, m, v, out, n, c)
                     : undo_range_s<GK, 2, true, 0>(p, grad, m, v, out, n, c);
}

// part 1 reads no grad and redoes nothing (adam_undo refuses a redo there)
static void adam_undo_range(float* p, const void* grad, int grad_dtype, float* m, float* v, uint16_t* out,
                            int out_dtype, int64_t n, const UndoCoeffs& c, int part, bool redo) {
    if (part == 1) undo_range_t<0, -1, false, 1, 0>(p, grad, m, v, out, n, c);
    else if (grad_dtype == 0) undo_range_g<0>(p, grad, m, v, out, out_dtype, n, c, part, redo);
    else if (grad_dtype == 1) undo_range_g<1>(p, grad, m, v, out, out_dtype, n, c, part, redo);
    else undo_range_g<2>(p, grad, m, v, out, out_dtype, n, c, part, redo);
}

// STREAM's triad a = b + s*c on float32, as the yardstick for the Adam: same compiler, flags, SIMD level
// and OpenMP threads. nt: non-temporal stores for a (a plain store reads a's line first).
static void triad_range(float* a, const float* b, const float* c, float s, int64_t n, bool nt) {
    const VecOps::T sv = VecOps::set(s);
    int64_t i = 0;
    if (nt && VecOps::kCanStream) {
        for (; i < n && !aligned_to(a + i, VecOps::W * 4); ++i) a[i] = b[i] + s * c[i];
        for (; i + VecOps::W <= n; i += VecOps::W)
            VecOps::stream(a + i, VecOps::add(VecOps::load(b + i), VecOps::mul(sv, VecOps::load(c + i))));
        VecOps::fence();
    } else {
        for (; i + VecOps::W <= n; i += VecOps::W)
            VecOps::store(a + i, VecOps::add(VecOps::load(b + i), VecOps::mul(sv, VecOps::load(c + i))));
    }
    for (; i < n; ++i) a[i] = b[i] + s * c[i];
}

static constexpr int64_t kTile = 1024;

// Largest |x| of a range, as the bit pattern of a float32 (16-bit inputs widened exactly).
// Bit patterns of non-negative floats order like their values, and NaN/inf sort above every
// finite value, so "max >= 0x7F800000" is "some element is not finite". An integer max over the
// bits vectorises (vpmaxud / vpmaxuw) and needs no float compares.
template <class U>
static U max_abs(const U* u, int64_t n) {
    const U mask = (U)(sizeof(U) == 4 ? 0x7FFFFFFFu : 0x7FFFu);
    U mx = 0;
    for (int64_t i = 0; i < n; ++i) { U a = u[i] & mask; mx = a > mx ? a : mx; }
    return mx;
}

static uint32_t max_abs_bits(const void* x, int dtype, int64_t n) {
    if (dtype == 0) return max_abs(static_cast<const uint32_t*>(x), n);
    const uint16_t mx = max_abs(static_cast<const uint16_t*>(x), n);
    if (dtype == 1) return (uint32_t)mx << 16;
    return f32_bits(f16_to_f32_soft(mx));  // fp16 inf/NaN map to fp32 inf/NaN patterns
}

// fp32 -> 16-bit, round to nearest even (both levels and the scalar tail agree bit for bit).
template <int OK>
static void cast_range_t(uint16_t* dst, const float* src, int64_t n) {
    int64_t i = 0;
    for (; i + VecOps::W <= n; i += VecOps::W) {
        if (OK == 1) VecOps::store_bf16(dst + i, VecOps::load(src + i));
        else VecOps::store_f16(dst + i, VecOps::load(src + i));
    }
    for (; i < n; ++i) dst[i] = OK == 1 ? f32_to_bf16(src[i]) : f32_to_f16_soft(src[i]);
}

static void cast_range(void* dst, int dst_dtype, const float* src, int64_t n) {
    if (dst_dtype == 1) cast_range_t<1>(static_cast<uint16_t*>(dst), src, n);
    else cast_range_t<2>(static_cast<uint16_t*>(dst), src, n);
}

// Sum of squares with float64 accumulation (exact products, so the only error is the adds).
static double sq_sum_range(const void* x, int dtype, int64_t n) {
    double acc = 0.0;
    if (dtype == 0) {
        const float* f = static_cast<const float*>(x);
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < n; ++i) { double d = f[i]; acc += d * d; }
        return acc;
    }
    const uint16_t* h = static_cast<const uint16_t*>(x);
    alignas(64) float buf[kTile];
    for (int64_t i0 = 0; i0 < n; i0 += kTile) {
        const int64_t len = n - i0 < kTile ? n - i0 : kTile;
        int64_t i = 0;
        if (dtype == 1) for (; i < len; ++i) buf[i] = bf16_to_f32(h[i0 + i]);
        else {
            for (; i + VecOps::W <= len; i += VecOps::W) VecOps::store(buf + i, VecOps::load_f16(h + i0 + i));
            for (; i < len; ++i) buf[i] = f16_to_f32_soft(h[i0 + i]);
        }
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < len; ++j) { double d = buf[j]; acc += d * d; }
    }
    return acc;
}
