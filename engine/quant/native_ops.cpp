// The AVX512 kernels (avx512_kernels.c) as typed torch operators, torch.ops.tandem.*: every
// tensor's device, dtype, rank, shape and layout is checked here, at the boundary, and a mismatch
// raises ValueError (the message names the op, the argument and what it wanted) before any C code
// reads or writes memory. Index tensors are range-checked where the kernel writes through them
// (write rows) or indexes tables with them (req_to_token rows, key ranges); the req_to_token
// entries themselves (key slots, read only) are the cache's invariant, not rechecked per step.
// (A stride is checked only along a dim of more than one element: a size-1 dim's stride is
// never used.) Built by native_lib.py with avx512_kernels.c into one library loaded by torch.ops.load_library.
//
// Threads: the kernels run at::get_num_threads() OpenMP threads (torch's runtime and setting);
// a GEMM call streaming little weight runs on one (avx512_kernels.c TQ_PAR_MIN_WORK).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

#include "avx512_kernels.h"

namespace {

using at::Tensor;
using c10::optional;

#define TQ_CHECK(cond, ...) TORCH_CHECK_VALUE(cond, op, ": ", __VA_ARGS__)

bool is_bf16(const Tensor &t) { return t.scalar_type() == at::kBFloat16; }

// A float32 or bfloat16 CPU tensor of `dim` dims with unit stride in its last one.
void check_float(const char *op, const char *name, const Tensor &t, int64_t dim) {
  TQ_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TQ_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
        " must be float32 or bfloat16, got ", t.scalar_type());
  TQ_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got shape ", t.sizes());
  TQ_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name, " must have unit stride in its last dim, got strides ",
        t.strides());
}

void check_index(const char *op, const char *name, const Tensor &t, at::ScalarType dt, int64_t n) {
  TQ_CHECK(t.device().is_cpu() && t.scalar_type() == dt && t.dim() == 1 && t.is_contiguous(), name,
        " must be a contiguous 1-dim CPU ", dt, " tensor, got ", t.scalar_type(), " ", t.sizes());
  TQ_CHECK(t.size(0) == n, name, " must have ", n, " entries, got ", t.size(0));
}

// A packed weight of `kind`: [N / 16, K / 32, record] uint8, contiguous. Returns (N, K).
std::pair<int64_t, int64_t> check_packed(const char *op, const char *name, int64_t kind, const Tensor &w) {
  const int64_t rec = tq_record_bytes((int)kind);
  TQ_CHECK(rec > 0, "unknown kernel kind ", kind, " (0..", TQ_KIND_LAST, ")");
  TQ_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 3 && w.is_contiguous(), name,
        " must be a contiguous [N/16, K/32, record] uint8 CPU tensor, got ", w.scalar_type(), " ",
        w.sizes());
  TQ_CHECK(w.size(2) == rec, name, " records must be ", rec, " bytes for kind ", kind, ", got ", w.size(2));
  return {w.size(0) * 16, w.size(1) * 32};
}

void check_rows(const char *op, const char *name, const Tensor &t, int64_t rows, int64_t cols) {
  TQ_CHECK(t.size(0) == rows && t.size(1) == cols, name, " must be [", rows, ", ", cols, "], got ", t.sizes());
}

// cos / sin of a rope over head dim d for T rows: [T, half] or [T, 1, half], unit stride in half.
void check_cos_sin(const char *op, const Tensor &x, const Tensor &cos, const Tensor &sin, int64_t T,
                   int64_t d) {
  for (const Tensor *t : {&cos, &sin}) {
    TQ_CHECK(t->device().is_cpu() && t->scalar_type() == x.scalar_type(), "cos and sin must be CPU ",
          x.scalar_type(), " (x's dtype), got ", t->scalar_type());
    TQ_CHECK((t->dim() == 2 || (t->dim() == 3 && t->size(1) == 1)) && t->size(0) == T && t->size(-1) == d / 2,
          "cos and sin must be [", T, ", ", d / 2, "] or [", T, ", 1, ", d / 2, "], got ", t->sizes());
    TQ_CHECK(t->stride(-1) == 1, "cos and sin must have unit stride in their last dim");
  }
  TQ_CHECK(sin.strides() == cos.strides(), "sin must have cos's strides: ", sin.strides(), " vs ", cos.strides());
}

// [lowest, highest] of a checked contiguous int64 index tensor (a plain loop: no dispatch per step)
std::pair<int64_t, int64_t> range_of(const Tensor &t) {
  const int64_t *p = t.data_ptr<int64_t>(), n = t.numel();
  int64_t a = n ? p[0] : 0, b = a;
  for (int64_t i = 1; i < n; i++) a = p[i] < a ? p[i] : a, b = p[i] > b ? p[i] : b;
  return {a, b};
}

// The paged-attention step tensors for T queries of `dt` over pools of [P, hkv, d] rows; returns
// the imap pointer (or null). Checks every index the kernel writes through or indexes a table with.
const int64_t *check_step(const char *op, at::ScalarType dt, int64_t T, int64_t hkv, int64_t d,
                          const Tensor &kpool, const Tensor &vpool, const Tensor &wrow, const Tensor &r2t,
                          const Tensor &rows, const Tensor &lo, const Tensor &hi, const optional<Tensor> &imap) {
  for (const Tensor *p : {&kpool, &vpool}) {
    TQ_CHECK(p->device().is_cpu() && p->scalar_type() == dt && p->dim() == 3 && p->is_contiguous(),
          "kpool and vpool must be contiguous 3-dim CPU ", dt, " tensors, got ", p->scalar_type(), " ",
          p->sizes());
    TQ_CHECK(p->size(1) == hkv && p->size(2) == d, "kpool and vpool must be [rows, ", hkv, ", ", d, "], got ",
          p->sizes());
  }
  TQ_CHECK(vpool.size(0) == kpool.size(0), "vpool must have kpool's rows");
  for (auto [name, t] : {std::pair{"wrow", &wrow}, {"rows", &rows}, {"lo", &lo}, {"hi", &hi}})
    check_index(op, name, *t, at::kLong, T);
  TQ_CHECK(r2t.device().is_cpu() && r2t.scalar_type() == at::kInt && r2t.dim() == 2 && r2t.stride(1) == 1,
        "req_to_token must be a 2-dim int32 CPU tensor with unit stride, got ", r2t.scalar_type(), " ",
        r2t.sizes());
  auto [w0, w1] = range_of(wrow);
  TQ_CHECK(T == 0 || (w0 >= 0 && w1 < kpool.size(0)), "write rows must lie in [0, ", kpool.size(0), "), got [",
        w0, ", ", w1, "]");
  auto [r0, r1] = range_of(rows);
  TQ_CHECK(T == 0 || (r0 >= 0 && r1 < r2t.size(0)), "rows must lie in [0, ", r2t.size(0), "), got [", r0, ", ",
        r1, "]");
  const int64_t *l = lo.data_ptr<int64_t>(), *h = hi.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++)
    TQ_CHECK(0 <= l[t] && l[t] <= h[t] && h[t] <= r2t.size(1), "query ", t, "'s key range [", l[t], ", ", h[t],
          ") must lie in [0, ", r2t.size(1), "]");
  if (!imap) return nullptr;
  TQ_CHECK(imap->device().is_cpu() && imap->scalar_type() == at::kLong && imap->dim() == 1 && imap->is_contiguous(),
        "imap must be a contiguous 1-dim int64 CPU tensor, got ", imap->scalar_type(), " ", imap->sizes());
  return imap->data_ptr<int64_t>();
}

// x [T, K] (or [T, 2K] for the gated pre-ops) and the norm weight of pre-op `pre`: given exactly
// with an RMSNorm, [K] in x's dtype (TQ_PRE_RMSNORM) or float32 (TQ_PRE_RMSNORM_F32).
void check_pre(const char *op, const Tensor &x, int64_t K, int64_t pre, const optional<Tensor> &nw) {
  TQ_CHECK(pre >= TQ_PRE_NONE && pre <= TQ_PRE_LAST, "unknown pre-op ", pre);
  check_float(op, "x", x, 2);
  const bool gated = pre == TQ_PRE_SILU_MUL || pre == TQ_PRE_GELU_MUL;
  check_rows(op, "x", x, x.size(0), gated ? 2 * K : K);
  const bool norm = pre == TQ_PRE_RMSNORM || pre == TQ_PRE_RMSNORM_F32;
  TQ_CHECK(norm == nw.has_value(), "the norm weight is given exactly with pre-op rmsnorm");
  if (!nw) return;
  if (pre == TQ_PRE_RMSNORM) {
    TQ_CHECK(nw->scalar_type() == x.scalar_type(), "the norm weight must have x's dtype ", x.scalar_type());
  } else {
    TQ_CHECK(nw->scalar_type() == at::kFloat, "the norm weight of pre-op rmsnorm_f32 must be float32, got ",
          nw->scalar_type());
  }
  check_float(op, "the norm weight", *nw, 1);
  TQ_CHECK(nw->size(0) == K, "the norm weight must have ", K, " entries, got ", nw->size(0));
}

// A float32 norm weight of n entries, contiguous.
void check_norm_f32(const char *op, const char *name, const Tensor &w, int64_t n) {
  TQ_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.is_contiguous() &&
            w.size(0) == n,
        name, " must be a contiguous [", n, "] float32 CPU tensor, got ", w.scalar_type(), " ", w.sizes());
}

void fail_on(const char *op, int rc) {
  TORCH_CHECK(rc == 0, op, " failed in the kernel (", rc, rc == -2 ? ": out of memory)" : ")");
}

// out[T, N] = pre(x) @ W^T (+ bias) (+ residual), into out (which may be a column slice).
void linear_(int64_t kind, const Tensor &wpack, const Tensor &x, Tensor &out, int64_t pre,
             const optional<Tensor> &nw, double eps, const optional<Tensor> &residual,
             const optional<Tensor> &bias) {
  const char *op = "tandem::linear_";
  auto [N, K] = check_packed(op, "wpack", kind, wpack);
  check_pre(op, x, K, pre, nw);
  const int64_t T = x.size(0);
  check_float(op, "out", out, 2);
  check_rows(op, "out", out, T, N);
  if (residual) {
    check_float(op, "residual", *residual, 2);
    check_rows(op, "residual", *residual, T, N);
  }
  if (bias) {
    check_float(op, "bias", *bias, 1);
    TQ_CHECK(bias->size(0) == N, "bias must have ", N, " entries, got ", bias->size(0));
  }
  if (T == 0) return;
  fail_on(op, tq_linear((int)kind, wpack.data_ptr<uint8_t>(), N, K, x.data_ptr(), x.stride(0), is_bf16(x),
                        (int)pre, nw ? nw->data_ptr() : nullptr, (float)eps, T, out.data_ptr(), out.stride(0),
                        is_bf16(out), residual ? residual->data_ptr() : nullptr, residual ? residual->stride(0) : 0,
                        residual && is_bf16(*residual), bias ? bias->data_ptr() : nullptr, bias && is_bf16(*bias),
                        at::get_num_threads()));
}

// What tq_linear multiplies for x (tests): (xq [T, K] int8 or bf16, sums or scales [T, K/32 or K/16]).
std::tuple<Tensor, Tensor> activations(int64_t kind, const Tensor &x, int64_t K, int64_t pre,
                                       const optional<Tensor> &nw, double eps) {
  const char *op = "tandem::activations";
  TQ_CHECK(tq_record_bytes((int)kind) > 0, "unknown kernel kind ", kind);
  TQ_CHECK(K > 0 && K % 32 == 0, "K must be a positive multiple of 32, got ", K);
  check_pre(op, x, K, pre, nw);
  const int64_t T = x.size(0);
  Tensor xq = at::empty({T, K}, x.options().dtype(kind == TQ_KIND_Q8_0 ? at::kChar : at::kBFloat16));
  Tensor dx = at::empty({T, K / (kind == TQ_KIND_K6 ? 16 : 32)}, x.options().dtype(at::kFloat));
  if (T > 0)
    fail_on(op, tq_activations((int)kind, x.data_ptr(), x.stride(0), is_bf16(x), T, K, (int)pre,
                               nw ? nw->data_ptr() : nullptr, (float)eps, xq.data_ptr(), dx.data_ptr<float>(),
                               at::get_num_threads()));
  return {xq, dx};
}

// Rotary embedding of x [T, H, D] in place (heads D apart, unit stride in D).
void rope_(Tensor &x, const Tensor &cos, const Tensor &sin) {
  const char *op = "tandem::rope_";
  check_float(op, "x", x, 3);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TQ_CHECK(D % 32 == 0, "the head dim must be a multiple of 32, got ", D);
  TQ_CHECK(H <= 1 || x.stride(1) == D, "x's heads must be D = ", D, " apart, got strides ", x.strides());
  check_cos_sin(op, x, cos, sin, T, D);
  if (T == 0) return;
  tq_rope(x.data_ptr(), T, x.stride(0), H, D, cos.data_ptr(), sin.data_ptr(), cos.stride(0), is_bf16(x));
}

// Write the step's K/V (k, v [T, Hkv, D]) to pool rows wrow, then attend q [T, Hq, D] -> [T, Hq, D].
Tensor attention(const Tensor &q, Tensor &kpool, Tensor &vpool, const Tensor &k, const Tensor &v,
                 const Tensor &wrow, const Tensor &r2t, const Tensor &rows, const Tensor &lo, const Tensor &hi,
                 const optional<Tensor> &imap, double scale) {
  const char *op = "tandem::attention";
  check_float(op, "q", q, 3);
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2);
  TQ_CHECK(d % 16 == 0 && d <= 256, "the head dim must be a multiple of 16 up to 256, got ", d);
  TQ_CHECK(hq <= 1 || q.stride(1) == d, "q's heads must be D = ", d, " apart, got strides ", q.strides());
  for (const Tensor *t : {&k, &v}) {
    TQ_CHECK(t->scalar_type() == q.scalar_type(), "k and v must have q's dtype ", q.scalar_type());
    check_float(op, "k and v", *t, 3);
    TQ_CHECK(t->size(0) == T && t->size(2) == d && (t->size(1) <= 1 || t->stride(1) == d), "k and v must be [", T, ", Hkv, ", d,
          "] with heads D apart, got ", t->sizes(), " strides ", t->strides());
  }
  const int64_t hkv = k.size(1);
  TQ_CHECK(v.size(1) == hkv && (T <= 1 || v.stride(0) == k.stride(0)), "v must have k's shape and row stride");
  TQ_CHECK(hkv > 0 && hq % hkv == 0, "q heads (", hq, ") must be a multiple of kv heads (", hkv, ")");
  const int64_t *im = check_step(op, q.scalar_type(), T, hkv, d, kpool, vpool, wrow, r2t, rows, lo, hi, imap);
  Tensor out = at::empty({T, hq, d}, q.options());
  if (T == 0) return out;
  fail_on(op, tq_attention(q.data_ptr(), q.stride(0), out.data_ptr(), T, hq, hkv, d, kpool.data_ptr(),
                           vpool.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), wrow.data_ptr<int64_t>(),
                           r2t.data_ptr<int32_t>(), r2t.stride(0), rows.data_ptr<int64_t>(),
                           lo.data_ptr<int64_t>(), hi.data_ptr<int64_t>(), im, (float)scale, is_bf16(q),
                           at::get_num_threads()));
  return out;
}

// Per-head RMSNorm of x [T, H, D] in place (heads D apart, unit stride in D) with w [D] float32.
void head_rmsnorm_(Tensor &x, const Tensor &w, double eps) {
  const char *op = "tandem::head_rmsnorm_";
  check_float(op, "x", x, 3);
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  TQ_CHECK(D > 0 && D % 16 == 0, "the head dim must be a positive multiple of 16, got ", D);
  TQ_CHECK(H <= 1 || x.stride(1) == D, "x's heads must be D = ", D, " apart, got strides ", x.strides());
  check_norm_f32(op, "w", w, D);
  if (T == 0 || H == 0) return;
  tq_head_rmsnorm(x.data_ptr(), T, x.stride(0), H, D, w.data_ptr<float>(), (float)eps, is_bf16(x),
                  at::get_num_threads());
}

// residual + rmsnorm(y) * w: y, residual [T, N] of one dtype, w [N] float32 -> a new [T, N].
Tensor add_rmsnorm(const Tensor &y, const Tensor &w, double eps, const Tensor &residual) {
  const char *op = "tandem::add_rmsnorm";
  check_float(op, "y", y, 2);
  const int64_t T = y.size(0), N = y.size(1);
  TQ_CHECK(N > 0 && N % 16 == 0, "the row width must be a positive multiple of 16, got ", N);
  check_float(op, "residual", residual, 2);
  TQ_CHECK(residual.scalar_type() == y.scalar_type(), "residual must have y's dtype ", y.scalar_type(), ", got ",
        residual.scalar_type());
  check_rows(op, "residual", residual, T, N);
  check_norm_f32(op, "w", w, N);
  Tensor out = at::empty({T, N}, y.options());
  if (T == 0) return out;
  tq_add_rmsnorm(y.data_ptr(), y.stride(0), w.data_ptr<float>(), (float)eps, residual.data_ptr(),
                 residual.stride(0), out.data_ptr(), N, T, N, is_bf16(y), at::get_num_threads());
  return out;
}

// One Llama layer on x [T, H] bf16: w = the four packed projections (qkv, o, gate_up, down),
// meta = their four kinds, then n_q, n_kv, head dim.
Tensor llama_layer(at::TensorList w, at::IntArrayRef meta, const Tensor &in_norm, const Tensor &post_norm,
                   double eps, double scale, const Tensor &x, const Tensor &cos, const Tensor &sin, Tensor &kpool,
                   Tensor &vpool, const Tensor &wrow, const Tensor &r2t, const Tensor &rows, const Tensor &lo,
                   const Tensor &hi, const optional<Tensor> &imap) {
  const char *op = "tandem::llama_layer";
  TQ_CHECK(w.size() == 4 && meta.size() == 7, "wants 4 weights and 7 meta values (4 kinds, n_q, n_kv, d), got ",
        w.size(), " and ", meta.size());
  LayerDesc L{};
  static const char *names[4] = {"qkv", "o", "gate_up", "down"};
  for (int i = 0; i < 4; i++) {
    auto [n, k] = check_packed(op, names[i], meta[i], w[i]);
    L.kind[i] = meta[i], L.w[i] = w[i].data_ptr<uint8_t>(), L.n[i] = n, L.k[i] = k;
  }
  L.n_q = meta[4], L.n_kv = meta[5], L.d = meta[6], L.eps = eps, L.scale = scale;
  const int64_t H = L.n[1], d = L.d;
  TQ_CHECK(L.n_kv > 0 && L.n_q % L.n_kv == 0 && d % 32 == 0 && d <= 256,
        "heads and head dim must satisfy n_q % n_kv == 0, d % 32 == 0, d <= 256, got ", L.n_q, ", ", L.n_kv, ", ", d);
  TQ_CHECK(L.k[0] == H && L.n[0] == (L.n_q + 2 * L.n_kv) * d && L.k[1] == L.n_q * d && L.k[2] == H &&
            L.n[2] == 2 * L.k[3] && L.n[3] == H,
        "the projections' shapes do not chain: qkv [", L.n[0], ", ", L.k[0], "], o [", L.n[1], ", ", L.k[1],
        "], gate_up [", L.n[2], ", ", L.k[2], "], down [", L.n[3], ", ", L.k[3], "]");
  TQ_CHECK(is_bf16(x) && x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
        "x must be a contiguous 2-dim bfloat16 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0);
  check_rows(op, "x", x, T, H);
  for (const Tensor *t : {&in_norm, &post_norm})
    TQ_CHECK(is_bf16(*t) && t->device().is_cpu() && t->dim() == 1 && t->is_contiguous() && t->size(0) == H,
          "the norm weights must be contiguous [", H, "] bfloat16, got ", t->scalar_type(), " ", t->sizes());
  L.in_norm = in_norm.data_ptr(), L.post_norm = post_norm.data_ptr();
  check_cos_sin(op, x, cos, sin, T, d);
  const int64_t *im = check_step(op, at::kBFloat16, T, L.n_kv, d, kpool, vpool, wrow, r2t, rows, lo, hi, imap);
  Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  fail_on(op, tq_llama_layer(&L, x.data_ptr(), out.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                             kpool.data_ptr(), vpool.data_ptr(), wrow.data_ptr<int64_t>(), r2t.data_ptr<int32_t>(),
                             r2t.stride(0), rows.data_ptr<int64_t>(), lo.data_ptr<int64_t>(),
                             hi.data_ptr<int64_t>(), im, at::get_num_threads()));
  return out;
}

// One Gemma 3 layer on x [T, H] bf16: w = the projections' packed parts in order (qkv's, o's, gate_up's,
// down's), meta = the four part counts, then each part's kind, then n_q, n_kv, head dim; norms = the
// six float32 weights (input, post-attention, pre-FF, post-FF [H]; q, k [D]).
Tensor gemma_layer(at::TensorList w, at::IntArrayRef meta, at::TensorList norms, double eps, double scale,
                   const Tensor &x, const Tensor &cos, const Tensor &sin, Tensor &kpool, Tensor &vpool,
                   const Tensor &wrow, const Tensor &r2t, const Tensor &rows, const Tensor &lo, const Tensor &hi,
                   const optional<Tensor> &imap) {
  const char *op = "tandem::gemma_layer";
  static const char *names[4] = {"qkv", "o", "gate_up", "down"};
  TQ_CHECK(meta.size() >= 4, "meta must start with the four projections' part counts, got ", meta.size(),
        " values");
  GemmaLayerDesc L{};
  int64_t total = 0;
  for (int i = 0; i < 4; i++) {
    TQ_CHECK(meta[i] >= 1 && meta[i] <= TQ_MAX_PARTS, names[i], " must have 1..", TQ_MAX_PARTS, " parts, got ",
          meta[i]);
    total += meta[i];
  }
  TQ_CHECK((int64_t)w.size() == total && (int64_t)meta.size() == 4 + total + 3, "wants ", total, " weights and ",
        4 + total + 3, " meta values (4 part counts, ", total, " kinds, n_q, n_kv, d), got ", w.size(), " and ",
        meta.size());
  int64_t j = 0, N[4];
  for (int i = 0; i < 4; i++) {
    ProjDesc &P = L.p[i];
    P.parts = meta[i], N[i] = 0;
    for (int64_t q = 0; q < P.parts; q++, j++) {
      auto [n, k] = check_packed(op, names[i], meta[4 + j], w[j]);
      TQ_CHECK(q == 0 || k == P.k, names[i], "'s parts must share one K, got ", P.k, " and ", k);
      P.kind[q] = meta[4 + j], P.w[q] = w[j].data_ptr<uint8_t>(), P.n[q] = n, P.k = k;
      N[i] += n;
    }
  }
  L.n_q = meta[4 + total], L.n_kv = meta[5 + total], L.d = meta[6 + total], L.eps = eps, L.scale = scale;
  const int64_t H = N[1], d = L.d;
  TQ_CHECK(L.n_kv > 0 && L.n_q > 0 && L.n_q % L.n_kv == 0 && d > 0 && d % 32 == 0 && d <= 256,
        "heads and head dim must satisfy n_q % n_kv == 0, d % 32 == 0, d <= 256, got ", L.n_q, ", ", L.n_kv,
        ", ", d);
  TQ_CHECK(L.p[0].k == H && N[0] == (L.n_q + 2 * L.n_kv) * d && L.p[1].k == L.n_q * d && L.p[2].k == H &&
            N[2] == 2 * L.p[3].k && N[3] == H,
        "the projections' shapes do not chain: qkv [", N[0], ", ", L.p[0].k, "], o [", N[1], ", ", L.p[1].k,
        "], gate_up [", N[2], ", ", L.p[2].k, "], down [", N[3], ", ", L.p[3].k, "]");
  TQ_CHECK(is_bf16(x) && x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
        "x must be a contiguous 2-dim bfloat16 CPU tensor, got ", x.scalar_type(), " ", x.sizes());
  const int64_t T = x.size(0);
  check_rows(op, "x", x, T, H);
  TQ_CHECK(norms.size() == 6, "wants 6 norm weights (input, post-attention, pre-FF, post-FF, q, k), got ",
        norms.size());
  static const char *norm_names[6] = {"the input norm", "the post-attention norm", "the pre-FF norm",
                                      "the post-FF norm", "the q norm", "the k norm"};
  for (int i = 0; i < 6; i++) check_norm_f32(op, norm_names[i], norms[i], i < 4 ? H : d);
  L.in_norm = norms[0].data_ptr<float>(), L.post_attn_norm = norms[1].data_ptr<float>();
  L.pre_ff_norm = norms[2].data_ptr<float>(), L.post_ff_norm = norms[3].data_ptr<float>();
  L.q_norm = norms[4].data_ptr<float>(), L.k_norm = norms[5].data_ptr<float>();
  check_cos_sin(op, x, cos, sin, T, d);
  const int64_t *im = check_step(op, at::kBFloat16, T, L.n_kv, d, kpool, vpool, wrow, r2t, rows, lo, hi, imap);
  Tensor out = at::empty({T, H}, x.options());
  if (T == 0) return out;
  fail_on(op, tq_gemma_layer(&L, x.data_ptr(), out.data_ptr(), T, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                             kpool.data_ptr(), vpool.data_ptr(), wrow.data_ptr<int64_t>(), r2t.data_ptr<int32_t>(),
                             r2t.stride(0), rows.data_ptr<int64_t>(), lo.data_ptr<int64_t>(),
                             hi.data_ptr<int64_t>(), im, at::get_num_threads()));
  return out;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("linear_(int kind, Tensor wpack, Tensor x, Tensor(a!) out, int pre, Tensor? nw, float eps, "
        "Tensor? residual, Tensor? bias) -> ()");
  m.def("activations(int kind, Tensor x, int k, int pre, Tensor? nw, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("attention(Tensor q, Tensor(a!) kpool, Tensor(b!) vpool, Tensor k, Tensor v, Tensor wrow, "
        "Tensor r2t, Tensor rows, Tensor lo, Tensor hi, Tensor? imap, float scale) -> Tensor");
  m.def("llama_layer(Tensor[] w, int[] meta, Tensor in_norm, Tensor post_norm, float eps, float scale, "
        "Tensor x, Tensor cos, Tensor sin, Tensor(a!) kpool, Tensor(b!) vpool, Tensor wrow, Tensor r2t, "
        "Tensor rows, Tensor lo, Tensor hi, Tensor? imap) -> Tensor");
  m.def("head_rmsnorm_(Tensor(a!) x, Tensor w, float eps) -> ()");
  m.def("add_rmsnorm(Tensor y, Tensor w, float eps, Tensor residual) -> Tensor");
  m.def("gemma_layer(Tensor[] w, int[] meta, Tensor[] norms, float eps, float scale, Tensor x, Tensor cos, "
        "Tensor sin, Tensor(a!) kpool, Tensor(b!) vpool, Tensor wrow, Tensor r2t, Tensor rows, Tensor lo, "
        "Tensor hi, Tensor? imap) -> Tensor");
}

TORCH_LIBRARY_IMPL(tandem, CPU, m) {
  m.impl("linear_", &linear_);
  m.impl("activations", &activations);
  m.impl("rope_", &rope_);
  m.impl("attention", &attention);
  m.impl("llama_layer", &llama_layer);
  m.impl("head_rmsnorm_", &head_rmsnorm_);
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("gemma_layer", &gemma_layer);
}
