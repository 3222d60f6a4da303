/* Tandem's CPU kernels for x86 with AVX512 (BF16 and VNNI). Built and loaded by
 * engine/quant/native_lib.py (gcc, cached per source hash). In this file, top to bottom:
 *   tq_linear       y = pre(x) @ W^T on a GGUF weight's own blocks   (engine/quant/avx512.py)
 *   tq_rope         rotary embedding in place, bitwise torch's        (engine/quant/avx512.py)
 *   tq_attention    paged attention: write K/V, attend in place       (engine/attention/cpu_backend.py)
 *   tq_head_rmsnorm, tq_add_rmsnorm  Gemma's per-head and sandwich RMSNorms (engine/models/gemma3_cpu.py)
 *   tq_llama_layer  a whole Llama layer: the above, composed          (engine/models/llama_cpu.py)
 *   tq_gemma_layer  a whole Gemma 3 layer, likewise                   (engine/models/gemma3_cpu.py)
 * Threads (OpenMP, torch's runtime) split only independent work -- columns, rows of activations,
 * (query run, kv head) pairs -- so no result depends on the thread count.
 *
 * The linear layers:
 *
 * Q4_0 / Q4_1 (bf16 activations, VDPBF16PS): a nibble q becomes the bfloat16 value 128 + q by
 * OR-ing it into 0x4300 (exact: [128, 256) has ulp 1 in bf16), so one block's dot product is
 *   acc = sum (128 + q) x   (float32, in VDPBF16PS order)     y += d acc + m' sum x
 * with m' = m - 128 d (Q4_1: w = d q + m) or -136 d (Q4_0: w = d (q - 8)) and sum x the block's
 * sum of the bf16 activations, in float32. The weights are exact; the activations are x rounded
 * to bf16 once (after the pre-op): the numerics of a bf16 model with the file's exact weights.
 * Q8_0 (int8 activations, VPDPBUSD, llama.cpp's way): each activation row is quantized per 32-wide
 * block to int8 (d_x = max|x| / 127, round to nearest even); a block's dot product with u = q + 128
 * (stored as u8) is exact in int32: y += d d_x (sum u xq - 128 sum xq).
 *
 * Every output element (row r, column n) is computed by the same instruction sequence whatever the
 * number of rows, the row tile it falls in and the thread count (threads split columns), so each
 * output row depends on its own input row only, bitwise.
 *
 * Packed weight layout (avx512.py's pack builds it): 16-column panels; per panel, per K block of
 * 32, one record: codes, then d (16 x fp16), then (Q4_1) m (16 x fp16).
 *   Q4_*: 256 code bytes = 4 chunks x 16 columns x 4 bytes. Column j's 32-bit lane of chunk i holds
 *         k = 8 i + 2 s in bits 4 s .. 4 s + 3 and k = 8 i + 2 s + 1 in bits 16 + 4 s .. (s = 0..3),
 *         so ((lane >> 4 s) & 0x000f000f) | 0x43004300 is the bf16 pair (k, k + 1) VDPBF16PS wants.
 *         Record 288 (Q4_0) / 320 (Q4_1) bytes.
 *   Q8_0: 512 code bytes = 8 chunks x 16 columns x 4 bytes: u = q + 128 of column j, k = 4 c + t.
 *         Record 544 bytes.
 *
 * The "KQ" kinds (Q5_0 / Q5_1 / the K-quants, bf16 activations): unsigned codes u (0..63) with
 * float32 per-group scale s and offset o, w = s u + o (exact: avx512.py's pack derives s, o from
 * the file's float16 d, dmin and 6/8-bit sub-scales, products that float32 holds exactly). As
 * Q4_1, a group's dot is acc = sum (128 + u) x, then y += s acc + (o - 128 s) sum x.
 *   KIND_K4 (Q4_K):            u's low nibbles as Q4_*, then s, o (16 x fp32 each). Record 384.
 *   KIND_K5 (Q5_0, Q5_1, Q5_K): nibbles, one high-bit plane (bit 4 of u), s, o. Record 448.
 *   KIND_K6 (Q6_K):            nibbles, planes for bits 4 and 5, then s and o of each 16-weight
 *                              half of the block (s0, s1, o0, o1). Record 640.
 *   KIND_K8 (Q8_0 layer weights with bf16 activations, u = q + 128 in 0..255): nibbles, planes for
 *                              bits 4..7, s, o = -128 s. 128 + u is not exact in bf16 past 255, so
 *                              bit 7 goes in a second VDPBF16PS on the same chain, as the bf16 128.0
 *                              or 0: (128 + u mod 128) x + (128 b7) x, both products exact. Record 640.
 *   A plane is 16 column lanes of 32 bits: k = 8 i + 2 t (+ 1) of chunk i at bit 4 t + i (+ 16),
 *   so the same shift that aligns chunk i's pair t for the nibbles aligns its high bits.
 *
 * Activations: rows of float32 or bfloat16, with an optional fused pre-op (RMSNorm with a weight in
 * x's dtype or in float32, or silu / gelu_tanh(x[:, :K]) * x[:, K:2K]) applied in float32 first.
 *
 * The entry points are declared in avx512_kernels.h; their callers are native_ops.cpp's torch
 * operators, which check shapes and dtypes first (the functions here trust their arguments).
 */
#include "avx512_kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_Q4_0 = TQ_KIND_Q4_0, KIND_Q4_1 = TQ_KIND_Q4_1, KIND_Q8_0 = TQ_KIND_Q8_0, KIND_K4 = TQ_KIND_K4,
       KIND_K5 = TQ_KIND_K5, KIND_K6 = TQ_KIND_K6, KIND_K8 = TQ_KIND_K8 };
enum { PRE_NONE = TQ_PRE_NONE, PRE_RMSNORM = TQ_PRE_RMSNORM, PRE_SILU_MUL = TQ_PRE_SILU_MUL,
       PRE_RMSNORM_F32 = TQ_PRE_RMSNORM_F32, PRE_GELU_MUL = TQ_PRE_GELU_MUL };

static inline int record_bytes(int kind) {
    switch (kind) {
    case KIND_Q8_0: return 544;
    case KIND_Q4_1: return 320;
    case KIND_K4: return 384;
    case KIND_K5: return 448;
    case KIND_K6: return 640;
    case KIND_K8: return 640;
    default: return 288;
    }
}

int tq_record_bytes(int kind) { return kind < KIND_Q4_0 || kind > KIND_K8 ? 0 : record_bytes(kind); }

/* -- float helpers ------------------------------------------------------------------------- */
static inline __m512 load16(const void *p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* float32 bits + the rounding increment: the top 16 bits are v rounded to bf16 (nearest even;
 * finite values) */
static inline __m512i rne_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
}

/* float32 -> bf16 bits (round to nearest even; a NaN stays a quiet NaN), 16 lanes */
static inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    __m512i r = rne_bits(v);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

static inline void store16(void *p, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)p, v);
        return;
    }
    _mm256_storeu_si256((__m256i *)p, to_bf16(v));
}

/* exp(x) for x in [-87, 87]: 2^n * P(f), |f| <= ln2 / 2, degree-6 Taylor (~2e-7 relative) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(87.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* -- activations: the pre-op, then bf16 rows (Q4_*) or int8 blocks (Q8_0) -------------------- */
typedef struct {
    const void *x;      /* this row */
    int bf16;
    int64_t K;
    int pre;
    const void *nw;
    float scale;        /* PRE_RMSNORM: 1 / rms of the row */
} Row;

/* 1 / rms of K values (K % 16 == 0): squares summed in 16 float32 lanes in order, then the lanes */
static inline float inv_rms(const void *x, int bf16, int64_t K, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v = load16((const char *)x + k * (bf16 ? 2 : 4), bf16);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    return 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps);
}

static inline Row row_begin(const void *x, int bf16, int64_t K, int pre, const void *nw, float eps) {
    Row r = {x, bf16, K, pre, nw, 1.0f};
    if (pre == PRE_RMSNORM || pre == PRE_RMSNORM_F32) r.scale = inv_rms(x, bf16, K, eps);
    return r;
}

/* gelu_tanh(a) = a (1 + tanh(z)) / 2 = a sigmoid(2 z), z = sqrt(2 / pi) (a + 0.044715 a^3): the
 * sigmoid form (exp16, as silu's) has no cancellation where tanh(z) nears -1 */
static inline __m512 gelu_tanh16(__m512 a) {
    const __m512 a2 = _mm512_mul_ps(a, a);
    const __m512 z2 = _mm512_mul_ps(a, _mm512_fmadd_ps(a2, _mm512_set1_ps(2.0f * 0.7978845608028654f * 0.044715f),
                                                       _mm512_set1_ps(2.0f * 0.7978845608028654f)));
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), z2));
    return _mm512_mul_ps(a, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

/* 16 values of pre(x) at k (float32) */
static inline __m512 row_at(const Row *r, int64_t k) {
    const int es = r->bf16 ? 2 : 4;
    __m512 a = load16((const char *)r->x + k * es, r->bf16);
    if (r->pre == PRE_RMSNORM) {
        a = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(r->scale)),
                          load16((const char *)r->nw + k * es, r->bf16));
    } else if (r->pre == PRE_RMSNORM_F32) {
        a = _mm512_mul_ps(_mm512_mul_ps(a, _mm512_set1_ps(r->scale)), _mm512_loadu_ps((const float *)r->nw + k));
    } else if (r->pre == PRE_GELU_MUL) {
        a = _mm512_mul_ps(gelu_tanh16(a), load16((const char *)r->x + (r->K + k) * es, r->bf16));
    } else if (r->pre == PRE_SILU_MUL) {
        __m512 up = load16((const char *)r->x + (r->K + k) * es, r->bf16);
        __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.0f),
                                   _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                 exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
        a = _mm512_mul_ps(_mm512_mul_ps(a, sig), up);
    }
    return a;
}

/* Q8_0 activations of one row: xq [K] int8, dx / isum [K/32] */
static void row_int8(const Row *r, int8_t *xq, float *dx, int32_t *isum) {
    for (int64_t b = 0; b < r->K / 32; b++) {
        __m512 v0 = row_at(r, 32 * b), v1 = row_at(r, 32 * b + 16);
        float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float id = m > 0.0f ? 127.0f / m : 0.0f;
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)(xq + 32 * b), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + 32 * b + 16), _mm512_cvtsepi32_epi8(q1));
        dx[b] = m / 127.0f;
        isum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* Q4_* activations of one row: xb [K] bf16, xs [K/32] (sum of each block's bf16 values) */
static void row_bf16(const Row *r, uint16_t *xb, float *xs) {
    for (int64_t b = 0; b < r->K / 32; b++) {
        __m256i h0 = to_bf16(row_at(r, 32 * b)), h1 = to_bf16(row_at(r, 32 * b + 16));
        _mm256_storeu_si256((__m256i *)(xb + 32 * b), h0);
        _mm256_storeu_si256((__m256i *)(xb + 32 * b + 16), h1);
        __m512 f0 = load16(xb + 32 * b, 1), f1 = load16(xb + 32 * b + 16, 1);
        xs[b] = _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
    }
}

/* KIND_K6 activations of one row: xb [K] bf16, xs [K/16] (sum of each 16-wide half block) */
static void row_bf16_16(const Row *r, uint16_t *xb, float *xs) {
    for (int64_t b = 0; b < r->K / 16; b++) {
        __m256i h = to_bf16(row_at(r, 16 * b));
        _mm256_storeu_si256((__m256i *)(xb + 16 * b), h);
        xs[b] = _mm512_reduce_add_ps(load16(xb + 16 * b, 1));
    }
}

/* -- the GEMMs ----------------------------------------------------------------------------- */
typedef struct {
    const int8_t *xq;       /* Q8_0: [T, K] int8, dx / isum [T, nb] */
    const float *dx;
    const int32_t *isum;
    const uint16_t *xb;     /* Q4_*: [T, K] bf16, xs [T, nb] */
    const float *xs;
    int64_t K, nb;
} Acts;

#define TILE_ROWS 4   /* rows per tile (the rest: one smaller tile) */

/* One 16-column panel over rows r0 .. r0 + R - 1 (Q8_0): y[r] = 16 float32 outputs. */
static inline __attribute__((always_inline)) void tile_q8(const int R, const uint8_t *wp,
                                                          const Acts *a, int64_t r0, __m512 *y) {
    const int rec = record_bytes(KIND_Q8_0);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) y[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        const uint8_t *blk = wp + b * rec;
        __m512i w[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) w[c] = _mm512_loadu_si512((const void *)(blk + 64 * c));
        const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 512)));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int64_t row = r0 + r;
            const int8_t *xr = a->xq + row * a->K + 32 * b;
            __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                int32_t x4;
                memcpy(&x4, xr + 4 * c, 4);
                acc = _mm512_dpbusd_epi32(acc, w[c], _mm512_set1_epi32(x4));
            }
            acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * a->isum[row * a->nb + b]));
            const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(a->dx[row * a->nb + b]));
            y[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), s, y[r]);
        }
    }
}

/* P (1 or 2) adjacent 16-column panels (records pstride bytes apart) over rows r0 .. r0 + R - 1
 * (Q4_0 / Q4_1, bf16 activations): y[p * TILE_ROWS + r]. Two panels share each activation
 * broadcast; a column's arithmetic is the same either way (two float32 chains per block, for
 * even and odd pair slots t, summed, then scaled). */
static inline __attribute__((always_inline)) void tile_q4(const int kind, const int R, const int P,
                                                          const uint8_t *wp, int64_t pstride,
                                                          const Acts *a, int64_t r0, __m512 *y) {
    const int rec = record_bytes(kind);
    const __m512i low = _mm512_set1_epi32(0x000f000f), magic = _mm512_set1_epi32(0x43004300);
#pragma GCC unroll 16
    for (int r = 0; r < P * TILE_ROWS; r++) y[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        __m512 acc[2][2][TILE_ROWS];   /* [panel][t & 1][row] */
#pragma GCC unroll 2
        for (int q = 0; q < P; q++)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512i pk[2];
#pragma GCC unroll 2
            for (int q = 0; q < P; q++)
                pk[q] = _mm512_loadu_si512((const void *)(wp + q * pstride + b * rec + 64 * i));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                /* the bf16 pairs (k, k + 1), k = 8 i + 2 t, of 16 columns */
                __m512bh w[2];
#pragma GCC unroll 2
                for (int q = 0; q < P; q++)
                    w[q] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(pk[q], 4 * t), low,
                                                               magic, 0xEA);   /* (a & b) | c */
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t x2;
                    memcpy(&x2, a->xb + (r0 + r) * a->K + 32 * b + 8 * i + 2 * t, 4);
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2);
#pragma GCC unroll 2
                    for (int q = 0; q < P; q++)
                        acc[q][t & 1][r] = _mm512_dpbf16_ps(acc[q][t & 1][r], w[q], xv);
                }
            }
        }
#pragma GCC unroll 2
        for (int q = 0; q < P; q++) {
            const uint8_t *blk = wp + q * pstride + b * rec;
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 256)));
            __m512 mw;   /* m' = m - 128 d (Q4_1) or -136 d (Q4_0) */
            if (kind == KIND_Q4_1)
                mw = _mm512_fnmadd_ps(dw, _mm512_set1_ps(128.0f),
                                      _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 288))));
            else
                mw = _mm512_mul_ps(dw, _mm512_set1_ps(-136.0f));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const __m512 sum = _mm512_add_ps(acc[q][0][r], acc[q][1][r]);
                __m512 *yr = &y[q * TILE_ROWS + r];
                *yr = _mm512_fmadd_ps(sum, dw, *yr);
                *yr = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->xs[(r0 + r) * a->nb + b]), *yr);
            }
        }
    }
}

/* bits p and 16 + p of each lane moved to bits at and 16 + at (p, at compile-time constants) */
static inline __attribute__((always_inline)) __m512i bits_to(__m512i h, const int p, const int at) {
    return p >= at ? _mm512_srli_epi32(h, (unsigned)(p - at)) : _mm512_slli_epi32(h, (unsigned)(at - p));
}

/* The KQ kinds (see the top of the file), as tile_q4: P panels over rows r0 .. r0 + R - 1. Two
 * float32 chains per group: pair slots t & 1 (K4, K5), or the two 16-weight halves (K6, whose
 * halves have their own scales). */
static inline __attribute__((always_inline)) void tile_kq(const int kind, const int R, const int P,
                                                          const uint8_t *wp, int64_t pstride,
                                                          const Acts *a, int64_t r0, __m512 *y) {
    const int rec = record_bytes(kind);
    const int nh = kind == KIND_K8 ? 4 : (kind == KIND_K6 ? 2 : (kind == KIND_K5 ? 1 : 0));
    const int halves = kind == KIND_K6;
    const int so = 256 + 64 * nh;                    /* s (, s1), o (, o1): 16 x fp32 each */
    const int64_t xsn = halves ? 2 * a->nb : a->nb;  /* activation sums per row */
    const __m512i low = _mm512_set1_epi32(0x000f000f), magic = _mm512_set1_epi32(0x43004300);
    const __m512i bit4 = _mm512_set1_epi32(0x00100010), bit5 = _mm512_set1_epi32(0x00200020);
    const __m512i bit6 = _mm512_set1_epi32(0x00400040), bit0 = _mm512_set1_epi32(0x00010001);
    const __m512i b128 = _mm512_set1_epi16(0x4300);   /* bf16 128.0 */
#pragma GCC unroll 16
    for (int r = 0; r < P * TILE_ROWS; r++) y[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a->nb; b++) {
        __m512 acc[2][2][TILE_ROWS];   /* [panel][chain][row] */
        __m512i h0[2], h1[2], h2[2], h3[2];
#pragma GCC unroll 2
        for (int q = 0; q < P; q++) {
            const uint8_t *blk = wp + q * pstride + b * rec;
            if (nh >= 1) h0[q] = _mm512_loadu_si512((const void *)(blk + 256));
            if (nh >= 2) h1[q] = _mm512_loadu_si512((const void *)(blk + 320));
            if (nh == 4) h2[q] = _mm512_loadu_si512((const void *)(blk + 384));
            if (nh == 4) h3[q] = _mm512_loadu_si512((const void *)(blk + 448));
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[q][0][r] = acc[q][1][r] = _mm512_setzero_ps();
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            __m512i pk[2];
#pragma GCC unroll 2
            for (int q = 0; q < P; q++)
                pk[q] = _mm512_loadu_si512((const void *)(wp + q * pstride + b * rec + 64 * i));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                __m512i w[2], w7[2];
#pragma GCC unroll 2
                for (int q = 0; q < P; q++) {
                    w[q] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(pk[q], 4 * t), low, magic, 0xEA);
                    if (nh >= 1) w[q] = _mm512_ternarylogic_epi32(bits_to(h0[q], 4 * t + i, 4), bit4, w[q], 0xEA);
                    if (nh >= 2) w[q] = _mm512_ternarylogic_epi32(bits_to(h1[q], 4 * t + i, 5), bit5, w[q], 0xEA);
                    if (nh == 4) {
                        w[q] = _mm512_ternarylogic_epi32(bits_to(h2[q], 4 * t + i, 6), bit6, w[q], 0xEA);
                        w7[q] = _mm512_mullo_epi16(_mm512_and_si512(bits_to(h3[q], 4 * t + i, 0), bit0), b128);
                    }
                }
                const int c = halves ? (i >> 1) : (t & 1);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    int32_t x2;
                    memcpy(&x2, a->xb + (r0 + r) * a->K + 32 * b + 8 * i + 2 * t, 4);
                    const __m512bh xv = (__m512bh)_mm512_set1_epi32(x2);
#pragma GCC unroll 2
                    for (int q = 0; q < P; q++) {
                        acc[q][c][r] = _mm512_dpbf16_ps(acc[q][c][r], (__m512bh)w[q], xv);
                        if (nh == 4) acc[q][c][r] = _mm512_dpbf16_ps(acc[q][c][r], (__m512bh)w7[q], xv);
                    }
                }
            }
        }
#pragma GCC unroll 2
        for (int q = 0; q < P; q++) {
            const float *sc = (const float *)(wp + q * pstride + b * rec + so);
            if (!halves) {
                const __m512 s = _mm512_loadu_ps(sc), mw = _mm512_fnmadd_ps(s, _mm512_set1_ps(128.0f), _mm512_loadu_ps(sc + 16));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const __m512 sum = _mm512_add_ps(acc[q][0][r], acc[q][1][r]);
                    __m512 *yr = &y[q * TILE_ROWS + r];
                    *yr = _mm512_fmadd_ps(sum, s, *yr);
                    *yr = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->xs[(r0 + r) * xsn + b]), *yr);
                }
            } else {
                const __m512 s0 = _mm512_loadu_ps(sc), s1 = _mm512_loadu_ps(sc + 16);
                const __m512 m0 = _mm512_fnmadd_ps(s0, _mm512_set1_ps(128.0f), _mm512_loadu_ps(sc + 32));
                const __m512 m1 = _mm512_fnmadd_ps(s1, _mm512_set1_ps(128.0f), _mm512_loadu_ps(sc + 48));
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const float *xs = a->xs + (r0 + r) * xsn + 2 * b;
                    __m512 *yr = &y[q * TILE_ROWS + r];
                    *yr = _mm512_fmadd_ps(acc[q][0][r], s0, *yr);
                    *yr = _mm512_fmadd_ps(m0, _mm512_set1_ps(xs[0]), *yr);
                    *yr = _mm512_fmadd_ps(acc[q][1][r], s1, *yr);
                    *yr = _mm512_fmadd_ps(m1, _mm512_set1_ps(xs[1]), *yr);
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void tile(const int kind, const int R, const int P,
                                                       const uint8_t *wp, int64_t pstride,
                                                       const Acts *a, int64_t r0, __m512 *y) {
    if (kind == KIND_Q8_0) tile_q8(R, wp, a, r0, y);          /* P == 1 */
    else if (kind >= KIND_K4) tile_kq(kind, R, P, wp, pstride, a, r0, y);
    else tile_q4(kind, R, P, wp, pstride, a, r0, y);
}

typedef struct {
    void *out;
    int64_t out_stride;
    int out_bf16;
    const void *res;
    int64_t res_stride;
    int res_bf16;
    const void *bias;
    int bias_bf16;
} Epilogue;

static inline __attribute__((always_inline)) void store_tile(const int R, const __m512 *y,
                                                             int64_t r0, int64_t n0,
                                                             const Epilogue *e) {
    __m512 bias = _mm512_setzero_ps();
    if (e->bias) bias = load16((const char *)e->bias + n0 * (e->bias_bf16 ? 2 : 4), e->bias_bf16);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        __m512 v = y[r];
        if (e->bias) v = _mm512_add_ps(v, bias);
        if (e->res) {
            const int64_t off = (r0 + r) * e->res_stride + n0;
            v = _mm512_add_ps(v, load16((const char *)e->res + off * (e->res_bf16 ? 2 : 4), e->res_bf16));
        }
        const int64_t off = (r0 + r) * e->out_stride + n0;
        store16((char *)e->out + off * (e->out_bf16 ? 2 : 4), v, e->out_bf16);
    }
}

/* P panels starting at column n0 (records of the second pstride bytes after the first). */
static inline __attribute__((always_inline)) void run_panels(const int kind, const int P,
                                                             const uint8_t *wp, int64_t pstride,
                                                             const Acts *a, int64_t T, int64_t n0,
                                                             const Epilogue *e) {
    __m512 y[2 * TILE_ROWS];
    for (int64_t r0 = 0; r0 < T; r0 += TILE_ROWS) {
        const int64_t left = T - r0;
        switch (left >= TILE_ROWS ? TILE_ROWS : left) {   /* the rest: one smaller tile */
        case 4: tile(kind, 4, P, wp, pstride, a, r0, y); break;
        case 3: tile(kind, 3, P, wp, pstride, a, r0, y); break;
        case 2: tile(kind, 2, P, wp, pstride, a, r0, y); break;
        default: tile(kind, 1, P, wp, pstride, a, r0, y); break;
        }
        const int R = left >= TILE_ROWS ? TILE_ROWS : (int)left;
        for (int q = 0; q < P; q++) store_tile(R, y + q * TILE_ROWS, r0, n0 + 16 * q, e);
    }
}

/* Work unit u of a GEMM: with several rows Q4 kinds take panel pairs (the last one alone when the
 * count is odd): one activation broadcast feeds two panels; one row streams one panel at a time.
 * Either way each column computes the same. */
#define PANELS(KIND, STEP)                                                                    \
    _Pragma("omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1)")      \
    for (int64_t u = 0; u < (np + STEP - 1) / STEP; u++) {                                   \
        const int64_t p = u * STEP;                                                          \
        if (STEP == 2 && p + 1 < np)                                                         \
            run_panels(KIND, 2, wpack + p * np_bytes, np_bytes, a, T, 16 * p, e);            \
        else                                                                                 \
            run_panels(KIND, 1, wpack + p * np_bytes, np_bytes, a, T, 16 * p, e);            \
    }

/* A call that streams less than this (rows x packed weight bytes) runs on one thread: waking the
 * team costs more than the split saves (a decode row through a small model's projection; libgomp's
 * workers sleep at once when it manages more threads than there are CPUs). Columns compute the
 * same on any thread count, so this changes no result. */
#define TQ_PAR_MIN_WORK (4 << 20)

static int gemm(int kind, const uint8_t *wpack, int64_t N, int64_t K, const Acts *a, int64_t T,
                const Epilogue *e, int nthreads) {
    const int64_t np = N / 16, np_bytes = (K / 32) * record_bytes(kind);
    if (T * np * np_bytes < TQ_PAR_MIN_WORK)
        nthreads = 1;
    const int64_t pair = T >= 2 ? 2 : 1;
    switch (kind) {
    case KIND_Q4_0: PANELS(KIND_Q4_0, pair) return 0;
    case KIND_Q4_1: PANELS(KIND_Q4_1, pair) return 0;
    case KIND_Q8_0: PANELS(KIND_Q8_0, 1) return 0;
    case KIND_K4: PANELS(KIND_K4, pair) return 0;
    case KIND_K5: PANELS(KIND_K5, pair) return 0;
    case KIND_K6: PANELS(KIND_K6, pair) return 0;
    case KIND_K8: PANELS(KIND_K8, pair) return 0;
    default: return -1;
    }
}

/* -- entry points -------------------------------------------------------------------------- */
static __thread uint8_t *scratch = NULL;
static __thread size_t scratch_bytes = 0;

static int ensure_scratch(size_t need) {
    if (need <= scratch_bytes) return 0;
    free(scratch);
    scratch_bytes = need > 2 * scratch_bytes ? need : 2 * scratch_bytes;
    scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
    if (!scratch) { scratch_bytes = 0; return -2; }
    return 0;
}

/* The activations of x for a ``kind`` weight, in this thread's scratch. */
static int prepare(int kind, const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t K,
                   int pre, const void *nw, float eps, Acts *a, int nthreads) {
    const int64_t nb = K / 32, es = x_bf16 ? 2 : 4;
    if (ensure_scratch((size_t)T * (size_t)(2 * K + 8 * nb) + 64)) return -2;
    float *f = (float *)scratch;
    Acts z = {0};
    z.K = K, z.nb = nb;
    if (kind == KIND_Q8_0) {
        z.dx = f, z.isum = (const int32_t *)(f + T * nb), z.xq = (const int8_t *)(f + 2 * T * nb);
    } else {   /* KIND_K6: sums per 16 (2 nb a row) */
        z.xs = f, z.xb = (const uint16_t *)(f + (kind == KIND_K6 ? 2 : 1) * T * nb);
    }
    *a = z;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 1)
    for (int64_t r = 0; r < T; r++) {
        const Row row = row_begin((const char *)x + r * x_stride * es, x_bf16, K, pre, nw, eps);
        if (kind == KIND_Q8_0)
            row_int8(&row, (int8_t *)z.xq + r * K, (float *)z.dx + r * nb, (int32_t *)z.isum + r * nb);
        else if (kind == KIND_K6)
            row_bf16_16(&row, (uint16_t *)z.xb + r * K, (float *)z.xs + r * 2 * nb);
        else
            row_bf16(&row, (uint16_t *)z.xb + r * K, (float *)z.xs + r * nb);
    }
    return 0;
}

/* out[T, N] = pre(x)[T, K] @ W^T (+ bias[N]) (+ res[T, N]); N % 16 == 0, K % 32 == 0.
 * x: [T, K] ([T, 2K] for PRE_SILU_MUL / PRE_GELU_MUL); strides in elements; *_bf16: bf16 (1) or float32 (0).
 * Returns 0, -1 for an unknown kind, -2 when the scratch cannot be allocated. */
int tq_linear(int kind, const uint8_t *wpack, int64_t N, int64_t K, const void *x, int64_t x_stride,
              int x_bf16, int pre, const void *nw, float eps, int64_t T, void *out,
              int64_t out_stride, int out_bf16, const void *res, int64_t res_stride, int res_bf16,
              const void *bias, int bias_bf16, int nthreads) {
    if (kind < KIND_Q4_0 || kind > KIND_K8) return -1;
    Acts a;
    int rc = prepare(kind, x, x_stride, x_bf16, T, K, pre, nw, eps, &a, nthreads);
    if (rc) return rc;
    const Epilogue e = {out, out_stride, out_bf16, res, res_stride, res_bf16, bias, bias_bf16};
    return gemm(kind, wpack, N, K, &a, T, &e, nthreads);
}

/* The activations tq_linear computes for x (tests): Q8_0 -> xq [T, K] int8 + dx [T, K/32];
 * Q4_* and KQ -> xb [T, K] bf16 (in xq's buffer, 2 bytes each) + xs [T, K/32] in dx (KIND_K6:
 * [T, K/16]). Returns as tq_linear. */
int tq_activations(int kind, const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t K,
                   int pre, const void *nw, float eps, void *xq, float *dx, int nthreads) {
    if (kind < KIND_Q4_0 || kind > KIND_K8) return -1;
    Acts a;
    int rc = prepare(kind, x, x_stride, x_bf16, T, K, pre, nw, eps, &a, nthreads);
    if (rc) return rc;
    const int64_t nb = K / 32;
    if (kind == KIND_Q8_0) {
        memcpy(xq, a.xq, (size_t)(T * K));
        memcpy(dx, a.dx, (size_t)(T * nb) * 4);
    } else {
        memcpy(xq, a.xb, (size_t)(T * K) * 2);
        memcpy(dx, a.xs, (size_t)(T * nb * (kind == KIND_K6 ? 2 : 1)) * 4);
    }
    return 0;
}

/* -- rotary embedding ("rotate_half" layout), in place -------------------------------------- */
/* v rounded to bf16 and back (round to nearest even; finite values) */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_and_si512(rne_bits(v), _mm512_set1_epi32((int)0xffff0000u)));
}

/* x: [T, H, D] at row stride x_stride (elements), halves x1 = [:D/2], x2 = [D/2:];
 * cos, sin: [T, D/2] at row stride cs_stride. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each
 * product and sum rounded to the dtype as torch's separate bf16 ops round them (Rotary.apply),
 * so the result is bitwise torch's. D / 2 % 16 == 0. */
void tq_rope(void *x, int64_t T, int64_t x_stride, int64_t H, int64_t D, const void *cos,
             const void *sin, int64_t cs_stride, int bf16) {
    const int64_t half = D / 2, es = bf16 ? 2 : 4;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 c = load16((const char *)cos + (t * cs_stride + i) * es, bf16);
            const __m512 s = load16((const char *)sin + (t * cs_stride + i) * es, bf16);
            for (int64_t h = 0; h < H; h++) {
                char *p1 = (char *)x + (t * x_stride + h * D + i) * es, *p2 = p1 + half * es;
                const __m512 a = load16(p1, bf16), b = load16(p2, bf16);
                __m512 o1, o2;
                if (bf16) {
                    o1 = round_bf16(_mm512_sub_ps(round_bf16(_mm512_mul_ps(a, c)), round_bf16(_mm512_mul_ps(b, s))));
                    o2 = round_bf16(_mm512_add_ps(round_bf16(_mm512_mul_ps(b, c)), round_bf16(_mm512_mul_ps(a, s))));
                } else {
                    o1 = _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s));
                    o2 = _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s));
                }
                store16(p1, o1, bf16);
                store16(p2, o2, bf16);
            }
        }
    }
}

/* -- Gemma's norms: per-head RMSNorm in place, residual + RMSNorm ------------------------------ */
/* Both normalize each row (head) by inv_rms, then multiply by the float32 weight, in float32. Rows
 * are independent and each is computed by one thread in order, so neither depends on the row count
 * or the thread count. */
void tq_head_rmsnorm(void *x, int64_t T, int64_t x_stride, int64_t H, int64_t D, const float *w, float eps,
                     int bf16, int nthreads) {
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            char *p = (char *)x + (t * x_stride + h * D) * es;
            const __m512 r = _mm512_set1_ps(inv_rms(p, bf16, D, eps));
            for (int64_t i = 0; i < D; i += 16)
                store16(p + i * es, _mm512_mul_ps(_mm512_mul_ps(load16(p + i * es, bf16), r),
                                                  _mm512_loadu_ps(w + i)), bf16);
        }
}

void tq_add_rmsnorm(const void *y, int64_t y_stride, const float *w, float eps, const void *res,
                    int64_t res_stride, void *out, int64_t out_stride, int64_t T, int64_t N, int bf16,
                    int nthreads) {
    const int64_t es = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++) {
        const char *yr = (const char *)y + t * y_stride * es, *rr = (const char *)res + t * res_stride * es;
        char *o = (char *)out + t * out_stride * es;
        const __m512 r = _mm512_set1_ps(inv_rms(yr, bf16, N, eps));
        for (int64_t i = 0; i < N; i += 16) {
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(load16(yr + i * es, bf16), r), _mm512_loadu_ps(w + i));
            if (bf16) v = round_bf16(v);
            store16(o + i * es, _mm512_add_ps(load16(rr + i * es, bf16), v), bf16);
        }
    }
}

/* -- paged attention ------------------------------------------------------------------------ */
/* Every query row is attended by the same instruction sequence whatever else is in the call:
 * its keys are visited in blocks of 16 absolute positions (block b = positions 16 b .. 16 b + 15),
 * in order, with an online softmax (running max m, sum l, output o, float32); inside a block the
 * scores are s_j = scale * sum_d q_d k_jd (float32: per key, FMAs over the 16-wide chunks of d in
 * order, then hsum16's fixed tree over the 16 lanes), lanes outside the query's [lo, hi) are masked, p_j = exp(s_j - m) (exp16), and
 * o = o * exp(m_old - m) + sum_j p_j v_j in key order. So a query's output is bitwise the same in a
 * prompt chunk, after a cached prefix, or as a decode row in any batch (the prefix cache on/off and
 * disaggregation oracles rely on it), and independent of the thread count. */
#define ATT_KEYS 16
#define ATT_QCHUNK 32
#define ATT_MAX_D 256
#define ATT_PV_HEADS 8    /* heads whose P.V chains run interleaved */

static inline __m512 exp_scalar_v(float x) { return exp16(_mm512_set1_ps(x)); }

typedef struct {
    const void *q;            /* [T, Hq, D], row stride q_stride */
    int64_t q_stride;
    void *out;                /* [T, Hq, D] contiguous */
    int64_t Hq, Hkv, D;
    const void *kpool, *vpool; /* [rows, Hkv, D] */
    const int32_t *r2t;       /* req_to_token [R, r2t_stride] */
    int64_t r2t_stride;
    const int64_t *seq_row, *lo, *hi;   /* per query: its req_to_token row, key positions [lo, hi) */
    const int64_t *imap;      /* full slot -> pool row, or NULL */
    float scale;
    int bf16;
} Att;

/* s[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once (a fixed tree of adds: lanes summed
 * in 128-bit halves, then chunks, then pairs, then neighbours; the same tree for every key). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)      /* [a0+a2, a1+a3 | b0+b2, b1+b3] (128-bit chunks) */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)      /* chunk q of d[i]: 4 partial sums of key 4 i + q */
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)      /* per chunk q: [x, y, x, y] partials of keys (8 i + q, 8 i + 4 + q) */
        e[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    /* lane 4 q + m: key 4 m + q */
    const __m512 r = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e[0]), _mm512_castps_pd(e[1]))));
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(perm, r);
}

static void attend_task(const Att *a, int64_t t0, int64_t t1, int64_t g, float *state) {
    const int64_t D = a->D, G = a->Hq / a->Hkv, nq = t1 - t0, es = a->bf16 ? 2 : 4;
    const int64_t nd = D / 16, row = a->seq_row[t0];
    /* state per (query, head i): qf [D], o [D], m, l */
    float *qf = state, *o = qf + nq * G * D, *ml = o + nq * G * D;
    int64_t blo = INT64_MAX, bhi = 0;
    for (int64_t t = t0; t < t1; t++) {
        if (a->lo[t] < blo) blo = a->lo[t];
        if (a->hi[t] > bhi) bhi = a->hi[t];
        for (int64_t i = 0; i < G; i++) {
            const char *qp = (const char *)a->q + (t * a->q_stride + (g * G + i) * D) * es;
            float *dst = qf + ((t - t0) * G + i) * D;
            for (int64_t c = 0; c < nd; c++) _mm512_storeu_ps(dst + 16 * c, load16(qp + 16 * c * es, a->bf16));
            memset(o + ((t - t0) * G + i) * D, 0, (size_t)D * 4);
            ml[2 * ((t - t0) * G + i)] = -INFINITY;
            ml[2 * ((t - t0) * G + i) + 1] = 0.0f;
        }
    }
    float *pj = ml + 2 * nq * G;          /* [G][16] this block's p of each head */
    float *alphas = pj + 16 * G;          /* [G] */
    float kb[ATT_KEYS * ATT_MAX_D] __attribute__((aligned(64)));   /* [16][D] */
    float vb[ATT_KEYS * ATT_MAX_D] __attribute__((aligned(64)));   /* [16][D] */
    const int64_t hstride = a->Hkv * D;
    for (int64_t b = blo / ATT_KEYS; b * ATT_KEYS < bhi; b++) {
        const int64_t p0 = b * ATT_KEYS;
        for (int64_t j = 0; j < ATT_KEYS; j++) {
            const int64_t pos = p0 + j;
            if (pos < blo || pos >= bhi) {
                memset(kb + j * D, 0, (size_t)D * 4);
                memset(vb + j * D, 0, (size_t)D * 4);
                continue;
            }
            int64_t slot = a->r2t[row * a->r2t_stride + pos];
            if (a->imap) slot = a->imap[slot];
            const char *kp = (const char *)a->kpool + (slot * hstride + g * D) * es;
            const char *vp = (const char *)a->vpool + (slot * hstride + g * D) * es;
            for (int64_t c = 0; c < nd; c++) {
                _mm512_store_ps(kb + j * D + 16 * c, load16(kp + 16 * c * es, a->bf16));
                _mm512_store_ps(vb + j * D + 16 * c, load16(vp + 16 * c * es, a->bf16));
            }
        }
        for (int64_t t = t0; t < t1; t++) {
            const int64_t lo = a->lo[t], hi = a->hi[t];
            if (p0 + ATT_KEYS <= lo || p0 >= hi) continue;
            const int64_t jlo = lo > p0 ? lo - p0 : 0, jhi = hi < p0 + ATT_KEYS ? hi - p0 : ATT_KEYS;
            const __mmask16 valid = (__mmask16)(((1u << jhi) - 1u) & ~((1u << jlo) - 1u));
            for (int64_t i = 0; i < G; i++) {   /* scores and the softmax update, head by head */
                const int64_t si = (t - t0) * G + i;
                const float *qv = qf + si * D;
                __m512 vj[ATT_KEYS];   /* per key: q * k summed over d mod 16 (d in 16-chunks, in order) */
                for (int j = 0; j < ATT_KEYS; j++) {
                    const float *kr = kb + j * D;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qv), _mm512_load_ps(kr));
                    for (int64_t c = 1; c < nd; c++)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qv + 16 * c), _mm512_load_ps(kr + 16 * c), acc);
                    vj[j] = acc;
                }
                __m512 s = _mm512_mul_ps(hsum16(vj), _mm512_set1_ps(a->scale));
                s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
                float *m = ml + 2 * si, *l = m + 1;
                const float bm = _mm512_reduce_max_ps(s);
                const float mn = bm > *m ? bm : *m;
                const float alpha = _mm_cvtss_f32(_mm512_castps512_ps128(exp_scalar_v(*m - mn)));
                const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mn))));
                *l = *l * alpha + _mm512_reduce_add_ps(p);
                *m = mn;
                _mm512_storeu_ps(pj + 16 * i, p);
                alphas[i] = alpha;
            }
            /* o = o * alpha + sum_j p_j v_j, per head in key order; up to ATT_PV_HEADS heads'
             * chains interleaved (each head's arithmetic is the same as alone) */
            for (int64_t i0 = 0; i0 < G; i0 += ATT_PV_HEADS) {
                const int nh = G - i0 < ATT_PV_HEADS ? (int)(G - i0) : ATT_PV_HEADS;
                for (int64_t c = 0; c < nd; c++) {
                    __m512 acc[ATT_PV_HEADS];
                    for (int h = 0; h < nh; h++)
                        acc[h] = _mm512_mul_ps(_mm512_loadu_ps(o + ((t - t0) * G + i0 + h) * D + 16 * c),
                                               _mm512_set1_ps(alphas[i0 + h]));
                    for (int64_t j = jlo; j < jhi; j++) {
                        const __m512 vc = _mm512_load_ps(vb + j * D + 16 * c);
                        for (int h = 0; h < nh; h++)
                            acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(pj[16 * (i0 + h) + j]), vc, acc[h]);
                    }
                    for (int h = 0; h < nh; h++)
                        _mm512_storeu_ps(o + ((t - t0) * G + i0 + h) * D + 16 * c, acc[h]);
                }
            }
        }
    }
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < G; i++) {
            const int64_t si = (t - t0) * G + i;
            const __m512 inv = _mm512_set1_ps(1.0f / ml[2 * si + 1]);
            char *op = (char *)a->out + ((t * a->Hq) + g * G + i) * D * es;
            for (int64_t c = 0; c < nd; c++)
                store16(op + 16 * c * es, _mm512_mul_ps(_mm512_loadu_ps(o + si * D + 16 * c), inv), a->bf16);
        }
}

/* Write the new tokens' K/V (knew/vnew [T, Hkv, D] at row stride new_stride, to pool rows wrow[t]),
 * then attend every query t over keys at positions [lo[t], hi[t]) of req_to_token row seq_row[t]
 * (pool row = imap[slot] when imap is given). Queries of one sequence must be consecutive. Query
 * head h reads KV head h / (Hq / Hkv). D % 16 == 0, D <= 256. Returns 0, -1 for a bad shape, -2
 * when memory runs out. */
int tq_attention(const void *q, int64_t q_stride, void *out, int64_t T, int64_t Hq, int64_t Hkv,
                 int64_t D, void *kpool, void *vpool, const void *knew, const void *vnew,
                 int64_t new_stride, const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                 const int64_t *seq_row, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                 float scale, int bf16, int nthreads) {
    if (D % 16 || D > ATT_MAX_D || Hkv <= 0 || Hq % Hkv) return -1;
    const int64_t es = bf16 ? 2 : 4, rowb = Hkv * D * es;
    for (int64_t t = 0; t < T; t++) {
        memcpy((char *)kpool + wrow[t] * rowb, (const char *)knew + t * new_stride * es, (size_t)rowb);
        memcpy((char *)vpool + wrow[t] * rowb, (const char *)vnew + t * new_stride * es, (size_t)rowb);
    }
    /* tasks: (a run of <= ATT_QCHUNK consecutive queries of one sequence, kv head) */
    int64_t ntask = 0;
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(T + 1));
    if (!starts) return -2;
    for (int64_t t = 0; t < T;) {
        int64_t e = t + 1;
        while (e < T && e - t < ATT_QCHUNK && seq_row[e] == seq_row[t]) e++;
        starts[ntask++] = t;
        t = e;
    }
    starts[ntask] = T;
    const Att a = {q, q_stride, out, Hq, Hkv, D, kpool, vpool, r2t, r2t_stride, seq_row, lo, hi,
                   imap, scale, bf16};
    const int64_t G = Hq / Hkv, state_floats = ATT_QCHUNK * G * (2 * D + 2) + 17 * G + 16;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && ntask * Hkv > 1)
    {
        float *state = malloc(sizeof(float) * (size_t)state_floats);
        if (!state) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < ntask * Hkv; w++)
            if (state) attend_task(&a, starts[w / Hkv], starts[w / Hkv + 1], w % Hkv, state);
        free(state);
    }
    free(starts);
    return failed ? -2 : 0;
}

/* -- one Llama decoder layer ---------------------------------------------------------------- */
/* LayerDesc (the static half of a layer): avx512_kernels.h. */

static __thread uint8_t *layer_scratch = NULL;
static __thread size_t layer_scratch_bytes = 0;

/* This thread's layer buffers, at least `need` bytes (64-byte aligned); NULL when memory runs out. */
static uint8_t *layer_buffers(size_t need) {
    if (need > layer_scratch_bytes) {
        free(layer_scratch);
        layer_scratch_bytes = need > 2 * layer_scratch_bytes ? need : 2 * layer_scratch_bytes;
        layer_scratch = aligned_alloc(64, (layer_scratch_bytes + 63) / 64 * 64);
        if (!layer_scratch) layer_scratch_bytes = 0;
    }
    return layer_scratch;
}

/* out[T, H] = the layer applied to x[T, H] (bf16, contiguous), exactly the composition
 * engine/models/llama.py runs with these kernels (same calls, same roundings):
 *   qkv = rmsnorm(x) @ Wqkv; rope(q, k); o = attention(q, k, v) (the K/V written first);
 *   x2 = o @ Wo + x; gu = rmsnorm(x2) @ Wgu; out = silu(g) * u @ Wd + x2.
 * cos, sin: [T, D/2] rows at cs_stride; the attention arguments are tq_attention's.
 * Returns 0, or tq_linear's / tq_attention's error. */
int tq_llama_layer(const LayerDesc *L, const void *x, void *out, int64_t T, const void *cos,
                   const void *sin, int64_t cs_stride, void *kpool, void *vpool,
                   const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                   const int64_t *rows, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                   int nthreads) {
    const int64_t H = L->n[1], nqkv = L->n[0], nqd = L->n_q * L->d, n2i = L->n[2];
    uint8_t *buf = layer_buffers((size_t)T * (size_t)(nqkv + nqd + H + n2i) * 2 + 256);
    if (!buf) return -2;
    uint16_t *qkv = (uint16_t *)buf, *att = qkv + T * nqkv, *x2 = att + T * nqd,
             *gu = x2 + T * H;
    const float eps = (float)L->eps;
    int rc = tq_linear((int)L->kind[0], L->w[0], nqkv, L->k[0], x, H, 1, PRE_RMSNORM, L->in_norm, eps,
                       T, qkv, nqkv, 1, NULL, 0, 0, NULL, 0, nthreads);
    if (rc) return rc;
    tq_rope(qkv, T, nqkv, L->n_q + L->n_kv, L->d, cos, sin, cs_stride, 1);
    rc = tq_attention(qkv, nqkv, att, T, L->n_q, L->n_kv, L->d, kpool, vpool, qkv + nqd,
                      qkv + nqd + L->n_kv * L->d, nqkv, wrow, r2t, r2t_stride, rows, lo, hi, imap,
                      (float)L->scale, 1, nthreads);
    if (rc) return rc;
    rc = tq_linear((int)L->kind[1], L->w[1], H, L->k[1], att, nqd, 1, PRE_NONE, NULL, 0.0f, T, x2, H,
                   1, x, H, 1, NULL, 0, nthreads);
    if (rc) return rc;
    rc = tq_linear((int)L->kind[2], L->w[2], n2i, L->k[2], x2, H, 1, PRE_RMSNORM, L->post_norm, eps,
                   T, gu, n2i, 1, NULL, 0, 0, NULL, 0, nthreads);
    if (rc) return rc;
    return tq_linear((int)L->kind[3], L->w[3], H, L->k[3], gu, n2i, 1, PRE_SILU_MUL, NULL, 0.0f, T,
                     out, H, 1, x2, H, 1, NULL, 0, nthreads);
}

/* -- one Gemma 3 decoder layer -------------------------------------------------------------- */
/* One projection: its parts in order, each tq_linear into its columns of out (Avx512Linear's calls). */
static int proj(const ProjDesc *P, const void *x, int64_t x_stride, int pre, const void *nw, float eps,
                int64_t T, uint16_t *out, int64_t out_stride, int nthreads) {
    int64_t c0 = 0;
    for (int64_t i = 0; i < P->parts; i++) {
        const int rc = tq_linear((int)P->kind[i], P->w[i], P->n[i], P->k, x, x_stride, 1, pre, nw, eps, T,
                                 out + c0, out_stride, 1, NULL, 0, 0, NULL, 0, nthreads);
        if (rc) return rc;
        c0 += P->n[i];
    }
    return 0;
}

/* out[T, H] = the layer applied to x[T, H] (bf16, contiguous), exactly the composition
 * engine/models/gemma3.py runs on its native path (same calls, same roundings):
 *   qkv = rmsnorm_in(x) @ Wqkv; q, k per-head rmsnorm; rope(q, k); o = attention(q, k, v) (the K/V
 *   written first); x2 = x + rmsnorm_post_attn(o @ Wo); gu = rmsnorm_pre_ff(x2) @ Wgu;
 *   out = x2 + rmsnorm_post_ff(gelu_tanh(g) * u @ Wd).
 * cos, sin: [T, D/2] rows at cs_stride; the attention arguments are tq_attention's.
 * Returns 0, or tq_linear's / tq_attention's error. */
int tq_gemma_layer(const GemmaLayerDesc *L, const void *x, void *out, int64_t T, const void *cos,
                   const void *sin, int64_t cs_stride, void *kpool, void *vpool,
                   const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                   const int64_t *rows, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                   int nthreads) {
    const int64_t nqd = L->n_q * L->d, nkd = L->n_kv * L->d, nqkv = nqd + 2 * nkd;
    const int64_t n2i = 2 * L->p[3].k;
    int64_t H = 0;   /* o's (and down's) width: the hidden size */
    for (int64_t i = 0; i < L->p[1].parts; i++) H += L->p[1].n[i];
    uint8_t *buf = layer_buffers((size_t)T * (size_t)(nqkv + nqd + 2 * H + n2i) * 2 + 256);
    if (!buf) return -2;
    uint16_t *qkv = (uint16_t *)buf, *att = qkv + T * nqkv, *y = att + T * nqd, *x2 = y + T * H,
             *gu = x2 + T * H;
    const float eps = (float)L->eps;
    int rc = proj(&L->p[0], x, H, PRE_RMSNORM_F32, L->in_norm, eps, T, qkv, nqkv, nthreads);
    if (rc) return rc;
    tq_head_rmsnorm(qkv, T, nqkv, L->n_q, L->d, L->q_norm, eps, 1, nthreads);
    tq_head_rmsnorm(qkv + nqd, T, nqkv, L->n_kv, L->d, L->k_norm, eps, 1, nthreads);
    tq_rope(qkv, T, nqkv, L->n_q + L->n_kv, L->d, cos, sin, cs_stride, 1);
    rc = tq_attention(qkv, nqkv, att, T, L->n_q, L->n_kv, L->d, kpool, vpool, qkv + nqd, qkv + nqd + nkd,
                      nqkv, wrow, r2t, r2t_stride, rows, lo, hi, imap, (float)L->scale, 1, nthreads);
    if (rc) return rc;
    rc = proj(&L->p[1], att, nqd, PRE_NONE, NULL, 0.0f, T, y, H, nthreads);
    if (rc) return rc;
    tq_add_rmsnorm(y, H, L->post_attn_norm, eps, x, H, x2, H, T, H, 1, nthreads);
    rc = proj(&L->p[2], x2, H, PRE_RMSNORM_F32, L->pre_ff_norm, eps, T, gu, n2i, nthreads);
    if (rc) return rc;
    rc = proj(&L->p[3], gu, n2i, PRE_GELU_MUL, NULL, 0.0f, T, y, H, nthreads);
    if (rc) return rc;
    tq_add_rmsnorm(y, H, L->post_ff_norm, eps, x2, H, out, H, T, H, 1, nthreads);
    return 0;
}
