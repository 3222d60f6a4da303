/* The C entry points of avx512_kernels.c, declared once: the C file includes this header (so the
 * compiler checks its definitions against these prototypes) and so does native_ops.cpp, the typed
 * torch operators that check every tensor's shape, dtype and layout before calling them. Nothing
 * else calls these functions; Python reaches them only through torch.ops.tandem (native_lib.py).
 *
 * Conventions: strides are in elements; a *_bf16 flag says bfloat16 (1) or float32 (0); weights
 * are avx512.py's packed panels [N / 16, K / 32, tq_record_bytes(kind)] uint8. Returns: 0, -1 for
 * a bad kind or shape, -2 when memory runs out. */
#ifndef TANDEM_AVX512_KERNELS_H
#define TANDEM_AVX512_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { TQ_KIND_Q4_0 = 0, TQ_KIND_Q4_1 = 1, TQ_KIND_Q8_0 = 2, TQ_KIND_K4 = 3, TQ_KIND_K5 = 4,
       TQ_KIND_K6 = 5, TQ_KIND_K8 = 6, TQ_KIND_LAST = 6 };
/* Pre-ops (applied to each activation row in float32 before the GEMM): RMSNorm with a weight in
 * x's dtype (Llama) or in float32 whatever x's dtype (Gemma's precomputed 1 + w); silu(g) * u or
 * gelu_tanh(g) * u over a [T, 2K] input. */
enum { TQ_PRE_NONE = 0, TQ_PRE_RMSNORM = 1, TQ_PRE_SILU_MUL = 2, TQ_PRE_RMSNORM_F32 = 3, TQ_PRE_GELU_MUL = 4,
       TQ_PRE_LAST = 4 };

/* Bytes of one packed record (16 columns x 32 K values) of a kind; 0 for an unknown kind. */
int tq_record_bytes(int kind);

int tq_linear(int kind, const uint8_t *wpack, int64_t N, int64_t K, const void *x, int64_t x_stride,
              int x_bf16, int pre, const void *nw, float eps, int64_t T, void *out,
              int64_t out_stride, int out_bf16, const void *res, int64_t res_stride, int res_bf16,
              const void *bias, int bias_bf16, int nthreads);

int tq_activations(int kind, const void *x, int64_t x_stride, int x_bf16, int64_t T, int64_t K,
                   int pre, const void *nw, float eps, void *xq, float *dx, int nthreads);

/* x [T, H, D] (rows at x_stride, heads D apart), each head's D values RMS-normalized in place with
 * the float32 weight w [D]: x * (1 / sqrt(mean(x^2) + eps)) * w, rounded to x's dtype once.
 * D % 16 == 0. */
void tq_head_rmsnorm(void *x, int64_t T, int64_t x_stride, int64_t H, int64_t D, const float *w, float eps,
                     int bf16, int nthreads);

/* out[T, N] = res + rmsnorm(y) * w (w float32 [N]); in bf16 the normed value is rounded to bf16
 * before the add and the sum rounded again (torch's two bf16 ops). N % 16 == 0; out may be res. */
void tq_add_rmsnorm(const void *y, int64_t y_stride, const float *w, float eps, const void *res,
                    int64_t res_stride, void *out, int64_t out_stride, int64_t T, int64_t N, int bf16,
                    int nthreads);

void tq_rope(void *x, int64_t T, int64_t x_stride, int64_t H, int64_t D, const void *cos,
             const void *sin, int64_t cs_stride, int bf16);

int tq_attention(const void *q, int64_t q_stride, void *out, int64_t T, int64_t Hq, int64_t Hkv,
                 int64_t D, void *kpool, void *vpool, const void *knew, const void *vnew,
                 int64_t new_stride, const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                 const int64_t *seq_row, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                 float scale, int bf16, int nthreads);

/* The static half of a Llama layer: the four projections' packed weights ([0] qkv, [1] o,
 * [2] gate_up, [3] down), the two RMSNorm weights (bf16), the shapes. Built per call by
 * native_ops.cpp from checked tensors, never by Python. */
typedef struct {
    int64_t kind[4];
    const uint8_t *w[4];
    int64_t n[4], k[4];
    const void *in_norm, *post_norm;
    double eps, scale;
    int64_t n_q, n_kv, d;
} LayerDesc;

int tq_llama_layer(const LayerDesc *L, const void *x, void *out, int64_t T, const void *cos,
                   const void *sin, int64_t cs_stride, void *kpool, void *vpool,
                   const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                   const int64_t *rows, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                   int nthreads);

/* The static half of a Gemma 3 layer: each projection ([0] qkv, [1] o, [2] gate_up, [3] down) as
 * up to TQ_MAX_PARTS packed parts side by side along N (a fused qkv of several GGUF kinds, as
 * Avx512Linear runs a QuantParts: one tq_linear per part into its columns); the six float32 norm
 * weights (1 + w): input, post-attention, pre-feed-forward, post-feed-forward [H], q, k [D]. */
#define TQ_MAX_PARTS 4
typedef struct {
    int64_t parts, k;                       /* K: the input width every part shares */
    int64_t kind[TQ_MAX_PARTS], n[TQ_MAX_PARTS];
    const uint8_t *w[TQ_MAX_PARTS];
} ProjDesc;

typedef struct {
    ProjDesc p[4];
    const float *in_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm, *q_norm, *k_norm;
    double eps, scale;
    int64_t n_q, n_kv, d;
} GemmaLayerDesc;

int tq_gemma_layer(const GemmaLayerDesc *L, const void *x, void *out, int64_t T, const void *cos,
                   const void *sin, int64_t cs_stride, void *kpool, void *vpool,
                   const int64_t *wrow, const int32_t *r2t, int64_t r2t_stride,
                   const int64_t *rows, const int64_t *lo, const int64_t *hi, const int64_t *imap,
                   int nthreads);

#ifdef __cplusplus
}
#endif

#endif
