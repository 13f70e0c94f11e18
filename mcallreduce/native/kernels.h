/* Element kernels of the compiled executor: reductions and scaling for every dtype.
 *
 * Each reduction step computes dst = op(dst, src), or op(src, dst) when the step says the
 * incoming data is the left operand; float16 is widened to float32, combined and rounded
 * once per step, as numpy's float16 ufuncs do. Integer sums and products wrap (unsigned
 * arithmetic), as numpy's and MPI's do.
 */
#ifndef MCALLREDUCE_KERNELS_H
#define MCALLREDUCE_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { DT_F16 = 1, DT_F32 = 2, DT_F64 = 3, DT_I32 = 4, DT_I64 = 5, DT_I8 = 6, DT_U8 = 7, DT_I16 = 8, DT_U16 = 9,
       DT_BOOL = 10 };
enum { OP_SUM = 1, OP_AVERAGE = 2, OP_MIN = 3, OP_MAX = 4, OP_PRODUCT = 5 };

static inline size_t dtype_size(int dtype) {
    switch (dtype) {
    case DT_I8: case DT_U8: case DT_BOOL: return 1;
    case DT_F16: case DT_I16: case DT_U16: return 2;
    case DT_F32: case DT_I32: return 4;
    case DT_F64: case DT_I64: return 8;
    default: return 0;
    }
}

/* IEEE binary16 <-> binary32, round to nearest even (numpy's npy_half conversions). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {   /* subnormal: normalise */
            int e = -1;
            do { e++; mant <<= 1; } while ((mant & 0x400u) == 0);
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, fexp = x & 0x7f800000u, fman = x & 0x007fffffu;
    if (fexp == 0x7f800000u) {                       /* inf or NaN (keep a NaN a NaN) */
        if (fman == 0) return (uint16_t)(sign | 0x7c00u);
        uint16_t m = (uint16_t)(fman >> 13);
        return (uint16_t)(sign | 0x7c00u | (m ? m : 1u));
    }
    if (fexp >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);   /* overflow to inf */
    if (fexp < 0x38800000u) {                        /* subnormal or zero in half */
        if (fexp < 0x33000000u) return (uint16_t)sign;            /* rounds to zero */
        uint32_t e = fexp >> 23, m = fman | 0x00800000u;
        uint32_t shift = 126 - e;                    /* 14..24 */
        uint32_t half_m = m >> shift, rest = m & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half_m & 1u))) half_m++;
        return (uint16_t)(sign | half_m);
    }
    uint32_t h = sign | (((fexp >> 23) - 127 + 15) << 10) | (fman >> 13);
    uint32_t rest = fman & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;    /* may carry into inf: correct */
    return (uint16_t)h;
}

/* min/max that keep a NaN and, for equal values, the left operand (numpy's minimum/maximum). */
#define KMIN(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))
#define KMAX(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))

#define DEFINE_LOOPS(NAME, T)                                                              \
    static void NAME##_reduce(int op, T *restrict d, const T *restrict s, int64_t n, int left) { \
        int64_t i;                                                                         \
        switch (op) {                                                                      \
        case OP_SUM: case OP_AVERAGE: for (i = 0; i < n; i++) d[i] = ADD(d[i], s[i]); break; \
        case OP_PRODUCT: for (i = 0; i < n; i++) d[i] = MUL(d[i], s[i]); break;            \
        case OP_MIN:                                                                       \
            if (left) { for (i = 0; i < n; i++) d[i] = KMIN(s[i], d[i]); }                 \
            else { for (i = 0; i < n; i++) d[i] = KMIN(d[i], s[i]); } break;               \
        case OP_MAX:                                                                       \
            if (left) { for (i = 0; i < n; i++) d[i] = KMAX(s[i], d[i]); }                 \
            else { for (i = 0; i < n; i++) d[i] = KMAX(d[i], s[i]); } break;               \
        }                                                                                  \
    }

/* out = op(a, b): the first step of a fold written straight to its destination, one pass
   instead of a copy and a reduction. */
#define DEFINE_COMBINE(NAME, T)                                                            \
    static void NAME##_combine(int op, T *restrict o, const T *a, const T *b, int64_t n) { \
        int64_t i;                                                                         \
        switch (op) {                                                                      \
        case OP_SUM: case OP_AVERAGE: for (i = 0; i < n; i++) o[i] = ADD(a[i], b[i]); break; \
        case OP_PRODUCT: for (i = 0; i < n; i++) o[i] = MUL(a[i], b[i]); break;            \
        case OP_MIN: for (i = 0; i < n; i++) o[i] = KMIN(a[i], b[i]); break;               \
        case OP_MAX: for (i = 0; i < n; i++) o[i] = KMAX(a[i], b[i]); break;               \
        }                                                                                  \
    }

#define ADD(a, b) ((a) + (b))
#define MUL(a, b) ((a) * (b))
DEFINE_COMBINE(f32, float)
DEFINE_COMBINE(f64, double)
DEFINE_COMBINE(u32, uint32_t)
DEFINE_COMBINE(u64, uint64_t)
DEFINE_COMBINE(s32, int32_t)
DEFINE_COMBINE(s64, int64_t)
DEFINE_LOOPS(f32, float)
DEFINE_LOOPS(f64, double)
DEFINE_LOOPS(u32, uint32_t)
DEFINE_LOOPS(u64, uint64_t)
DEFINE_LOOPS(s32, int32_t)
DEFINE_LOOPS(s64, int64_t)
#undef MUL
#define MUL(a, b) ((unsigned)(a) * (unsigned)(b))   /* 8- and 16-bit operands promote to int, which may overflow */
DEFINE_LOOPS(u8, uint8_t)
DEFINE_LOOPS(s8, int8_t)
DEFINE_LOOPS(u16, uint16_t)
DEFINE_LOOPS(s16, int16_t)
DEFINE_COMBINE(u8, uint8_t)
DEFINE_COMBINE(s8, int8_t)
DEFINE_COMBINE(u16, uint16_t)
DEFINE_COMBINE(s16, int16_t)
#undef ADD
#undef MUL

/* float16 goes through float32 arithmetic with one rounding per step, as the numpy path does. */
static inline uint16_t f16_apply(int op, uint16_t ha, uint16_t hb) {
    float a = half_to_float(ha), b = half_to_float(hb), r;
    switch (op) {
    case OP_PRODUCT: r = a * b; break;
    case OP_MIN: r = KMIN(a, b); break;
    case OP_MAX: r = KMAX(a, b); break;
    default: r = a + b;
    }
    return float_to_half(r);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define F16C_TARGET __attribute__((target("avx,f16c")))

/* The same arithmetic 8 lanes at a time with the CPU's own conversions, which round alike
   (to nearest even); only a signalling NaN comes out quiet, where the scalar path keeps it. */
F16C_TARGET static inline __m256 f16c_apply(int op, __m256 a, __m256 b) {
    switch (op) {
    case OP_PRODUCT: return _mm256_mul_ps(a, b);
    case OP_MIN: return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_LE_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    case OP_MAX: return _mm256_blendv_ps(b, a, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q)));
    default: return _mm256_add_ps(a, b);
    }
}

/* o = op(a, b); o may be a or b (each block of 8 is loaded before it is stored). */
F16C_TARGET static void f16c_combine(int op, uint16_t *o, const uint16_t *a, const uint16_t *b, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(o + i), _mm256_cvtps_ph(f16c_apply(op, x, y), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) o[i] = f16_apply(op, a[i], b[i]);
}

/* b *= f, through float32 as the scalar path. */
F16C_TARGET static void f16c_scale(uint16_t *b, int64_t n, float f) {
    int64_t i = 0;
    __m256 factor = _mm256_set1_ps(f);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(b + i), _mm256_cvtps_ph(_mm256_mul_ps(x, factor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    for (; i < n; i++) b[i] = float_to_half(half_to_float(b[i]) * f);
}

static inline int have_f16c(void) {
    static int known = -1;   /* a benign race: every thread computes the same answer */
    if (known < 0) known = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    return known;
}
#else
static inline int have_f16c(void) { return 0; }
static inline void f16c_combine(int op, uint16_t *o, const uint16_t *a, const uint16_t *b, int64_t n) { (void)op; (void)o; (void)a; (void)b; (void)n; }
static inline void f16c_scale(uint16_t *b, int64_t n, float f) { (void)b; (void)n; (void)f; }
#endif

static inline void f16_reduce(int op, uint16_t *restrict d, const uint16_t *restrict s, int64_t n, int left) {
    if (have_f16c()) { f16c_combine(op, d, left ? s : d, left ? d : s, n); return; }
    for (int64_t i = 0; i < n; i++) d[i] = left ? f16_apply(op, s[i], d[i]) : f16_apply(op, d[i], s[i]);
}

/* One call of the kernel family VERB (reduce or combine) for the dtype: integer sums and products
   wrap, so they run unsigned; min and max compare signed. A bool is a byte of 0 or 1 whose sum and
   product the caller has already made max and min (logical or and and, as numpy's). */
#define DTYPE_DISPATCH(dtype, op, VERB, ...)                                                          \
    switch (dtype) {                                                                                    \
    case DT_F16: f16_##VERB(op, __VA_ARGS__); break;                                                    \
    case DT_F32: f32_##VERB(op, __VA_ARGS__); break;                                                    \
    case DT_F64: f64_##VERB(op, __VA_ARGS__); break;                                                    \
    case DT_I32: if (op == OP_MIN || op == OP_MAX) s32_##VERB(op, __VA_ARGS__); else u32_##VERB(op, __VA_ARGS__); break; \
    case DT_I64: if (op == OP_MIN || op == OP_MAX) s64_##VERB(op, __VA_ARGS__); else u64_##VERB(op, __VA_ARGS__); break; \
    case DT_I8: if (op == OP_MIN || op == OP_MAX) s8_##VERB(op, __VA_ARGS__); else u8_##VERB(op, __VA_ARGS__); break;    \
    case DT_I16: if (op == OP_MIN || op == OP_MAX) s16_##VERB(op, __VA_ARGS__); else u16_##VERB(op, __VA_ARGS__); break; \
    case DT_U8: case DT_BOOL: u8_##VERB(op, __VA_ARGS__); break;                                        \
    case DT_U16: u16_##VERB(op, __VA_ARGS__); break;                                                    \
    }

static inline void f16_combine(int op, uint16_t *restrict o, const uint16_t *a, const uint16_t *b, int64_t n) {
    if (have_f16c()) { f16c_combine(op, o, a, b, n); return; }
    for (int64_t i = 0; i < n; i++) o[i] = f16_apply(op, a[i], b[i]);
}

/* dst = op(dst, src) over n elements (operands swapped when left). */
static inline void reduce_into(int dtype, int op, void *dst, const void *src, int64_t n, int left) {
    DTYPE_DISPATCH(dtype, op, reduce, dst, src, n, left)
}

/* out = op(a, b) over n elements; out overlaps neither operand. */
static inline void combine_into(int dtype, int op, void *out, const void *a, const void *b, int64_t n) {
    DTYPE_DISPATCH(dtype, op, combine, out, a, b, n)
}

/* buf *= factor in place, as Horovod scales CPU buffers: float16 through float32, float32 and
 * float64 in their own type, integers in float64 and truncated. */
static inline void scale_buffer(int dtype, void *buf, int64_t n, double factor) {
    int64_t i;
    if (factor == 1.0) return;
    switch (dtype) {
    case DT_F16: {
        uint16_t *b = buf;
        float f = (float)factor;
        if (have_f16c()) { f16c_scale(b, n, f); break; }
        for (i = 0; i < n; i++) b[i] = float_to_half(half_to_float(b[i]) * f);
        break;
    }
    case DT_F32: { float *b = buf, f = (float)factor; for (i = 0; i < n; i++) b[i] *= f; break; }
    case DT_F64: { double *b = buf; for (i = 0; i < n; i++) b[i] *= factor; break; }
    case DT_I32: { int32_t *b = buf; for (i = 0; i < n; i++) b[i] = (int32_t)((double)b[i] * factor); break; }
    case DT_I64: { int64_t *b = buf; for (i = 0; i < n; i++) b[i] = (int64_t)((double)b[i] * factor); break; }
    /* through int64, so that a product outside the narrow type wraps (as numpy's cast does here)
       instead of being undefined */
    case DT_I8: { int8_t *b = buf; for (i = 0; i < n; i++) b[i] = (int8_t)(int64_t)((double)b[i] * factor); break; }
    case DT_U8: { uint8_t *b = buf; for (i = 0; i < n; i++) b[i] = (uint8_t)(int64_t)((double)b[i] * factor); break; }
    case DT_I16: { int16_t *b = buf; for (i = 0; i < n; i++) b[i] = (int16_t)(int64_t)((double)b[i] * factor); break; }
    case DT_U16: { uint16_t *b = buf; for (i = 0; i < n; i++) b[i] = (uint16_t)(int64_t)((double)b[i] * factor); break; }
    }   /* a bool is never scaled: the runtime refuses it */
}

#endif
