"""Matrix-vector kernels for 4- and 8-bit weights with float32 activations (CPU), compiled
on first use.

Why our own: batch-1 decode reads every weight once per token, so it wants few bytes per
weight *and* a kernel that keeps up with memory.  PyTorch's weight-only CPU kernels
(``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) only vectorise bf16 activations
on an AVX2 machine (their float32 paths are scalar), and bf16 activations change a small
model's greedy answers.  These kernels read llama.cpp's own grids -- Q4_1 (``w = q * scale +
min``, q in [0, 15]) and Q8_0 (``w = q * scale``, q in [-127, 127]), one fp16 scale (and min)
per group of 32 inputs -- and multiply in float32, so a Q4_1/Q8_0 GGUF runs its file's exact
weights at float32 activations: the float32 mode's arithmetic on 0.625 / 1.06 bytes per
weight.

Layouts (built by ``pack_q4`` / ``pack_q8``):

- Q4: ``packed [N, K/2] uint8``: byte ``16 g + j`` of a row holds q of inputs ``32 g + j``
  (low nibble) and ``32 g + j + 16`` (high nibble); ``scales``, ``mins``: ``[N, K/32]`` fp16.
- Q8: ``q [N, K] int8``; ``scales [N, K/32]`` fp16.

``q4_linear`` / ``q8_linear`` take ``x [M, K]`` float32 (M <= 16: decode rows) and return
``[M, N]`` float32, rows split over torch's intra-op threads.  The source is compiled with
``torch.utils.cpp_extension`` (a C++ compiler and ninja) for this CPU, once, into torch's
extension cache; ``available()`` says whether that worked (the int4 mode needs it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import time

import torch

__all__ = [
    "MAX_ROWS",
    "available",
    "build_directory",
    "pack_q4",
    "pack_q8",
    "q4_decoder",
    "q4_dequantize",
    "q4_linear",
    "q8_linear",
    "unpack_q4",
    "unpack_q8",
]

logger = logging.getLogger("edge_engine")

GROUP = 32  # inputs per scale (llama.cpp's QK4_1 = QK8_0 = 32)
MAX_ROWS = 16  # rows of x per call (the kernels keep one accumulator per row)
_STALE_LOCK_S = 600  # a build lock older than this was left by a build that died

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define EDGE_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 16;

#ifdef EDGE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float half_to_float(const at::Half h) { return _cvtsh_ss(h.x); }
// one group's 32 weights (unpacked, in four registers) times 32 inputs, as 8 partial sums
inline __m256 dot32(__m256 q0, __m256 q1, __m256 q2, __m256 q3, const float* xg) {
  __m256 t0 = _mm256_mul_ps(q0, _mm256_loadu_ps(xg));
  __m256 t1 = _mm256_mul_ps(q1, _mm256_loadu_ps(xg + 8));
  t0 = _mm256_fmadd_ps(q2, _mm256_loadu_ps(xg + 16), t0);
  t1 = _mm256_fmadd_ps(q3, _mm256_loadu_ps(xg + 24), t1);
  return _mm256_add_ps(t0, t1);
}
#else
inline float half_to_float(const at::Half h) { return static_cast<float>(h); }
#endif

// ---- weights ---------------------------------------------------------------------------
struct Q4 {  // Q4_1 grid: packed [N, K/2] uint8, scales and mins [N, K/32] fp16
  const uint8_t* packed;
  const at::Half* scales;
  const at::Half* mins;
  int64_t N, K;
};

struct Q8 {  // Q8_0 grid: q [N, K] int8, scales [N, K/32] fp16
  const int8_t* q;
  const at::Half* scales;
  int64_t N, K;
};

Q4 q4_of(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& mins) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kByte && packed.is_contiguous(), "packed must be [N, K/2] uint8");
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  for (const auto* t : {&scales, &mins}) {
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() && t->dim() == 2, "scales/mins must be fp16");
    TORCH_CHECK(t->size(0) == N && t->size(1) == K / kGroup, "scales/mins must be [N, K/32]");
  }
  return {packed.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), N, K};
}

Q8 q8_of(const torch::Tensor& q, const torch::Tensor& scales) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.is_contiguous(), "q must be [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % kGroup == 0, "K must be a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && scales.is_contiguous() && scales.dim() == 2, "scales must be fp16");
  TORCH_CHECK(scales.size(0) == N && scales.size(1) == K / kGroup, "scales must be [N, K/32]");
  return {q.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), N, K};
}

// ---- matrix-vector products: y[M, N] = x[M, K] W^T, M <= 16, rows of W over the threads ----
// y[m, n] = sum_g scale[n, g] * sum_k q[n, g, k] * x[m, 32 g + k] + min[n, g] * sum_k x[m, 32 g + k]
void q4_gemv(const float* x, int64_t M, const Q4& w, float* y) {
  const int64_t N = w.N, K = w.K, G = K / kGroup;
  std::vector<float> xsum(M * G);  // the min term's factor
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float t = 0.f;
      for (int64_t k = 0; k < kGroup; ++k) t += x[m * K + g * kGroup + k];
      xsum[m * G + g] = t;
    }
  const float* xs = xsum.data();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* row = w.packed + n * (K / 2);
      const at::Half* srow = w.scales + n * G;
      const at::Half* mrow = w.mins + n * G;
      float accmin[kMaxRows];
#ifdef EDGE_AVX2
      const __m128i low4 = _mm_set1_epi8(0x0F);
      __m256 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) { acc[m] = _mm256_setzero_ps(); accmin[m] = 0.f; }
      for (int64_t g = 0; g < G; ++g) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
        const __m128i lo = _mm_and_si128(b, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
        const __m256 s = _mm256_set1_ps(half_to_float(srow[g]));
        const float mn = half_to_float(mrow[g]);
        for (int64_t m = 0; m < M; ++m) {
          acc[m] = _mm256_fmadd_ps(dot32(q0, q1, q2, q3, x + m * K + g * kGroup), s, acc[m]);
          accmin[m] += mn * xs[m * G + g];
        }
      }
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]) + accmin[m];
#else
      float acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) { acc[m] = 0.f; accmin[m] = 0.f; }
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = row + g * 16;
        const float s = half_to_float(srow[g]), mn = half_to_float(mrow[g]);
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = x + m * K + g * kGroup;
          float t = 0.f;
          for (int j = 0; j < 16; ++j) t += float(b[j] & 15) * xg[j] + float(b[j] >> 4) * xg[j + 16];
          acc[m] += s * t;
          accmin[m] += mn * xs[m * G + g];
        }
      }
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m] + accmin[m];
#endif
    }
  });
}

// y[m, n] = sum_g scale[n, g] * sum_k q[n, g, k] * x[m, 32 g + k]
void q8_gemv(const float* x, int64_t M, const Q8& w, float* y) {
  const int64_t N = w.N, K = w.K, G = K / kGroup;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = w.q + n * K;
      const at::Half* srow = w.scales + n * G;
#ifdef EDGE_AVX2
      __m256 acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* b = row + g * kGroup;
        const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
        const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))));
        const __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 16))));
        const __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 24))));
        const __m256 s = _mm256_set1_ps(half_to_float(srow[g]));
        for (int64_t m = 0; m < M; ++m) {
          acc[m] = _mm256_fmadd_ps(dot32(q0, q1, q2, q3, x + m * K + g * kGroup), s, acc[m]);
        }
      }
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = hsum(acc[m]);
#else
      float acc[kMaxRows];
      for (int64_t m = 0; m < M; ++m) acc[m] = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* b = row + g * kGroup;
        const float s = half_to_float(srow[g]);
        for (int64_t m = 0; m < M; ++m) {
          const float* xg = x + m * K + g * kGroup;
          float t = 0.f;
          for (int k = 0; k < kGroup; ++k) t += float(b[k]) * xg[k];
          acc[m] += s * t;
        }
      }
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = acc[m];
#endif
    }
  });
}

torch::Tensor check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be [M, K] float32");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most 16 rows");
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  return x.contiguous();
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor mins) {
  const Q4 w = q4_of(packed, scales, mins);
  x = check_x(x, w.K);
  auto y = torch::empty({x.size(0), w.N}, x.options());
  q4_gemv(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
  return y;
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scales) {
  const Q8 w = q8_of(q, scales);
  x = check_x(x, w.K);
  auto y = torch::empty({x.size(0), w.N}, x.options());
  q8_gemv(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>());
  return y;
}

// The float32 weight [N, K] a Q4 triple stands for (prefill: dequantise once, then a GEMM).
torch::Tensor q4_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor mins) {
  const Q4 w = q4_of(packed, scales, mins);
  const int64_t N = w.N, K = w.K, G = K / kGroup;
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = w.packed + n * (K / 2) + g * 16;
        const float s = half_to_float(w.scales[n * G + g]), mn = half_to_float(w.mins[n * G + g]);
        float* o = op + n * K + g * kGroup;
#pragma omp simd
        for (int j = 0; j < 16; ++j) {
          o[j] = float(b[j] & 15) * s + mn;
          o[j + 16] = float(b[j] >> 4) * s + mn;
        }
      }
    }
  });
  return out;
}

// ---- the decode step ------------------------------------------------------------------------
// x[i] = exp(x[i]): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial
// (relative error ~1e-7, float32's own).  Softmax and SiLU need ~10^6 of these per step.
void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef EDGE_AVX2
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const __m256 c2 = _mm256_set1_ps(1.f / 2), c3 = _mm256_set1_ps(1.f / 6), c4 = _mm256_set1_ps(1.f / 24);
  const __m256 c5 = _mm256_set1_ps(1.f / 120), c6 = _mm256_set1_ps(1.f / 720), one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_loadu_ps(x + i), lo), hi);
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_fnmadd_ps(k, ln2_hi, v);
    v = _mm256_fnmadd_ps(k, ln2_lo, v);
    __m256 p = _mm256_fmadd_ps(c6, v, c5);
    p = _mm256_fmadd_ps(p, v, c4);
    p = _mm256_fmadd_ps(p, v, c3);
    p = _mm256_fmadd_ps(p, v, c2);
    p = _mm256_fmadd_ps(p, v, one);
    p = _mm256_fmadd_ps(p, v, one);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + i, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
#endif
  for (; i < n; ++i) x[i] = std::exp(x[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void rms_norm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float ms = dot(x, x, n) / static_cast<float>(n);
  const float r = 1.f / std::sqrt(ms + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * weight[i];
}

// HF rotate_half RoPE on one head: x * cos + roll(x, D/2) * signed_sin (the model's table)
void rope(float* x, const float* cos, const float* ssin, int64_t D) {
  float t[512];
  const int64_t h = D / 2;
  for (int64_t i = 0; i < D; ++i) t[i] = x[i] * cos[i] + x[(i + h) % D] * ssin[i];
  std::memcpy(x, t, D * sizeof(float));
}

// One query head over its paged context: out = softmax(q . K^T * scale) V.  K and V rows of
// token t sit at (table[t / bs] * bs + t % bs) * slot_stride + kv_offset.
void attend(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t bs, int64_t slot_stride,
            int64_t kv_offset, int64_t C, int64_t D, float scale, float* s, float* out) {
#ifdef EDGE_AVX2
  if (D == 64) {
    __m256 qv[8];
    for (int c = 0; c < 8; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
    float mx = -INFINITY;
    for (int64_t t = 0; t < C; ++t) {
      const float* k = kc + (table[t / bs] * bs + t % bs) * slot_stride + kv_offset;
      __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k)), a1 = _mm256_mul_ps(qv[1], _mm256_loadu_ps(k + 8));
      a0 = _mm256_fmadd_ps(qv[2], _mm256_loadu_ps(k + 16), a0);
      a1 = _mm256_fmadd_ps(qv[3], _mm256_loadu_ps(k + 24), a1);
      a0 = _mm256_fmadd_ps(qv[4], _mm256_loadu_ps(k + 32), a0);
      a1 = _mm256_fmadd_ps(qv[5], _mm256_loadu_ps(k + 40), a1);
      a0 = _mm256_fmadd_ps(qv[6], _mm256_loadu_ps(k + 48), a0);
      a1 = _mm256_fmadd_ps(qv[7], _mm256_loadu_ps(k + 56), a1);
      s[t] = hsum(_mm256_add_ps(a0, a1));
      mx = std::max(mx, s[t]);
    }
    for (int64_t t = 0; t < C; ++t) s[t] -= mx;
    exp_inplace(s, C);
    float sum = 0.f;
    for (int64_t t = 0; t < C; ++t) sum += s[t];
    __m256 o[8];
    for (int c = 0; c < 8; ++c) o[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < C; ++t) {
      const float* v = vc + (table[t / bs] * bs + t % bs) * slot_stride + kv_offset;
      const __m256 p = _mm256_set1_ps(s[t]);
      for (int c = 0; c < 8; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), o[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(o[c], inv));
    return;
  }
#endif
  float mx = -INFINITY;
  for (int64_t t = 0; t < C; ++t) {
    const float* k = kc + (table[t / bs] * bs + t % bs) * slot_stride + kv_offset;
    s[t] = dot(q, k, D) * scale;
    mx = std::max(mx, s[t]);
  }
  for (int64_t t = 0; t < C; ++t) s[t] -= mx;
  exp_inplace(s, C);
  float sum = 0.f;
  for (int64_t t = 0; t < C; ++t) sum += s[t];
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t t = 0; t < C; ++t) {
    const float* v = vc + (table[t / bs] * bs + t % bs) * slot_stride + kv_offset;
    const float p = s[t];
    for (int64_t d = 0; d < D; ++d) out[d] += p * v[d];
  }
  const float inv = 1.f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// One layer's weights, in the order Q4Decoder takes them (14 tensors).
struct Layer {
  const float* attn_norm;
  Q4 wqkv, wo;
  const float* ffn_norm;
  Q4 w13, w2;
};

// Batch-1..16 decode through all layers in one call: the same arithmetic as model.py's
// TransformerBlock (float32 activations, the Q4 weights), without ~100 Python-dispatched
// ops per layer.  The KV cache is model.py's paged layout; each row has its own blocks.
class Q4Decoder {
 public:
  Q4Decoder(std::vector<torch::Tensor> params, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps)
      : params_(std::move(params)), H_(num_heads), KH_(num_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(params_.size() % 14 == 0, "14 tensors per layer");
    TORCH_CHECK(D_ <= 512 && H_ % KH_ == 0, "bad attention shape");
    for (size_t i = 0; i < params_.size(); i += 14) {
      const auto& p = params_;
      for (size_t j : {i, i + 7})
        TORCH_CHECK(p[j].scalar_type() == torch::kFloat && p[j].is_contiguous(), "norm weights must be float32");
      layers_.push_back({p[i].data_ptr<float>(), q4_of(p[i + 1], p[i + 2], p[i + 3]), q4_of(p[i + 4], p[i + 5], p[i + 6]),
                         p[i + 7].data_ptr<float>(), q4_of(p[i + 8], p[i + 9], p[i + 10]), q4_of(p[i + 11], p[i + 12], p[i + 13])});
    }
    hidden_ = layers_.at(0).wo.N;
    ffn_ = layers_.at(0).w2.K;
    TORCH_CHECK(layers_[0].wqkv.N == (H_ + 2 * KH_) * D_ && layers_[0].w13.N == 2 * ffn_, "bad layer shapes");
  }

  // x: [B, hidden] embeddings; rope: [B, 2, D] (cos, signed sin) at each row's position;
  // k_caches, v_caches: per layer [num_blocks, block_size, KH, D]; slots: [B] (where this
  // token's K/V go); tables: [B, W] (each row's blocks); lens: [B] (context length with
  // this token).  Returns the last layer's output [B, hidden].
  torch::Tensor forward(torch::Tensor x, torch::Tensor rope_rows, std::vector<torch::Tensor> k_caches,
                        std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor tables, torch::Tensor lens) {
    const int64_t B = x.size(0), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(B >= 1 && B <= kMaxRows && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat, "x must be [B <= 16, hidden]");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == L && static_cast<int64_t>(v_caches.size()) == L, "one cache per layer");
    for (const auto& c : k_caches) TORCH_CHECK(c.sizes() == k_caches[0].sizes(), "cache shapes");
    for (const auto& c : v_caches) TORCH_CHECK(c.sizes() == k_caches[0].sizes(), "cache shapes");
    for (const auto* cs : {&k_caches, &v_caches})
      for (const auto& c : *cs)
        TORCH_CHECK(c.scalar_type() == torch::kFloat && c.is_contiguous() && c.dim() == 4 && c.size(2) == KH_ && c.size(3) == D_,
                    "caches must be [num_blocks, block_size, KH, D] float32");
    for (const auto* t : {&slots, &tables, &lens})
      TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(), "int64 metadata");
    TORCH_CHECK(tables.size(0) == B && slots.size(0) == B && lens.size(0) == B, "one entry per row");
    rope_rows = rope_rows.contiguous();
    auto out = x.to(torch::kFloat).contiguous().clone();
    float* h = out.data_ptr<float>();
    const int64_t qkv_n = (H_ + 2 * KH_) * D_, num_blocks = k_caches[0].size(0), bs = k_caches[0].size(1), W = tables.size(1);
    const int64_t slot_stride = KH_ * D_;
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    const int64_t* len = lens.data_ptr<int64_t>();
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(len[b] >= 1 && len[b] <= W * bs && slot[b] >= 0 && slot[b] < num_blocks * bs, "row metadata out of range");
      max_len = std::max(max_len, len[b]);
    }
    std::vector<float> normed(B * std::max(hidden_, ffn_)), qkv(B * qkv_n), att(B * H_ * D_), gu(B * 2 * ffn_),
        act(B * ffn_), tmp(B * hidden_), scores(B * H_ * max_len);
    const float* rp = rope_rows.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(D_));
    const int64_t group = H_ / KH_;  // query heads per KV head
    for (int64_t l = 0; l < L; ++l) {
      const Layer& w = layers_[l];
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      for (int64_t b = 0; b < B; ++b) rms_norm(h + b * hidden_, w.attn_norm, normed.data() + b * hidden_, hidden_, eps_);
      q4_gemv(normed.data(), B, w.wqkv, qkv.data());
      for (int64_t b = 0; b < B; ++b) {
        float* r = qkv.data() + b * qkv_n;
        const float* cs = rp + b * 2 * D_;
        for (int64_t head = 0; head < H_ + KH_; ++head) rope(r + head * D_, cs, cs + D_, D_);
        std::memcpy(kc + slot[b] * slot_stride, r + H_ * D_, slot_stride * sizeof(float));
        std::memcpy(vc + slot[b] * slot_stride, r + (H_ + KH_) * D_, slot_stride * sizeof(float));
      }
      // attention: one task per (row, query head), each over its row's paged context
      const int64_t work = B * H_ * max_len * D_;
      at::parallel_for(0, B * H_, work < (1 << 15) ? B * H_ : 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t b = task / H_, head = task % H_, C = len[b];
          const int64_t* tb = table + b * W;
          const int64_t kv_offset = (head / group) * D_;
          const float* q = qkv.data() + b * qkv_n + head * D_;
          float* sc = scores.data() + task * max_len;
          attend(q, kc, vc, tb, bs, slot_stride, kv_offset, C, D_, scale, sc, att.data() + task * D_);
        }
      });
      q4_gemv(att.data(), B, w.wo, tmp.data());
      for (int64_t i = 0; i < B * hidden_; ++i) h[i] += tmp[i];
      for (int64_t b = 0; b < B; ++b) rms_norm(h + b * hidden_, w.ffn_norm, normed.data() + b * hidden_, hidden_, eps_);
      q4_gemv(normed.data(), B, w.w13, gu.data());
      for (int64_t b = 0; b < B; ++b) {  // SiLU(gate) * up
        const float* gate = gu.data() + b * 2 * ffn_;
        const float* up = gate + ffn_;
        float* a = act.data() + b * ffn_;
        for (int64_t i = 0; i < ffn_; ++i) a[i] = -gate[i];
        exp_inplace(a, ffn_);
#pragma omp simd
        for (int64_t i = 0; i < ffn_; ++i) a[i] = gate[i] / (1.f + a[i]) * up[i];
      }
      q4_gemv(act.data(), B, w.w2, tmp.data());
      for (int64_t i = 0; i < B * hidden_; ++i) h[i] += tmp[i];
    }
    return out;
  }

 private:
  std::vector<torch::Tensor> params_;  // keeps the weights alive
  std::vector<Layer> layers_;
  int64_t H_, KH_, D_, hidden_ = 0, ffn_ = 0;
  float eps_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the step thread lets go of the GIL while it computes, as torch's own ops do
  m.def("q4_linear", &q4_linear, "Q4_1-grid weights x float32 activations", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q8_linear", &q8_linear, "Q8_0-grid weights x float32 activations", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_dequantize", &q4_dequantize, "Q4_1-grid weights to float32", pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<Q4Decoder>(m, "Q4Decoder")
      .def(pybind11::init<std::vector<torch::Tensor>, int64_t, int64_t, int64_t, double>())
      .def("forward", &Q4Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
"""


def _cpu_fingerprint() -> str:
    """The build is for this CPU (-march=native): name it by the CPU's feature flags, so a
    shared extension cache never hands one machine's build to another kind of CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return flags or platform.processor() or platform.machine()


_CFLAGS, _LDFLAGS = ["-O3", "-march=native", "-fopenmp"], ["-fopenmp"]


def build_directory() -> str:
    """Where this source, for this CPU, torch and Python, is compiled (torch's extension root)."""
    from torch.utils import cpp_extension

    key = "\n".join([_SOURCE, _cpu_fingerprint(), torch.__version__, platform.python_version(), *_CFLAGS])
    name = f"edge_engine_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    return os.path.join(cpp_extension.get_default_build_root(), name)


@functools.cache
def _module():
    """Compile (first call on this machine: ~1 min) or load the cached build; None if that
    fails (no compiler, no ninja), after logging why."""
    if platform.machine().lower() not in ("x86_64", "amd64", "aarch64", "arm64"):
        return None
    from torch.utils import cpp_extension  # imported lazily: only the int4 mode needs it

    build_dir = build_directory()
    try:
        os.makedirs(build_dir, exist_ok=True)
        # a build killed half-way leaves its lock behind, and every later start would wait on
        # it for ever: a lock older than any real build (~1 min) is stale
        lock = os.path.join(build_dir, "lock")
        if os.path.exists(lock) and time.time() - os.path.getmtime(lock) > _STALE_LOCK_S:
            logger.warning("edge_engine: removing a stale kernel build lock %s", lock)
            os.remove(lock)
        # -fopenmp: at::parallel_for is inlined here, and splits rows over torch's own OpenMP
        # threads only when this file is compiled with OpenMP (else it runs them all on one)
        return cpp_extension.load_inline(
            name=os.path.basename(build_dir),
            cpp_sources=[_SOURCE],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler or ninja shows up here, in many forms
        logger.warning("edge_engine: the quantised matrix-vector kernels could not be built: %s", exc)
        return None


def available() -> bool:
    """Whether the kernels are built (compiles them on the first call)."""
    return _module() is not None


def q4_decoder(params: list[torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int, eps: float):
    """A ``Q4Decoder`` over the layers' weights: 14 tensors per layer, in order attention
    norm, wqkv (packed, scales, mins), wo (3), ffn norm, w13 (3), w2 (3).  Its
    ``forward(x, rope_rows, k_caches, v_caches, slots, tables, lens)`` runs a decode step's
    1-16 rows through every layer in one call."""
    return _module().Q4Decoder(params, num_heads, num_kv_heads, head_dim, eps)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    # x: [M, K] float32 (M <= MAX_ROWS); packed: [N, K/2] uint8; scales, mins: [N, K/32] fp16 -> [M, N]
    return _module().q4_linear(x, packed, scales, mins)


def q8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # x: [M, K] float32 (M <= MAX_ROWS); q: [N, K] int8; scales: [N, K/32] fp16 -> [M, N]
    return _module().q8_linear(x, q, scales)


def pack_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed [N, K/2] uint8, scales [N, K/32] fp16, mins [N, K/32] fp16).

    Q4_1's rule: a group's min at q = 0 and its max at q = 15 (``scale = (max - min) / 15``),
    both stored in fp16 -- so a weight that came from a Q4_1 file is recovered exactly.
    """
    w = weight.float()
    N, K = w.shape
    assert K % GROUP == 0, f"in_features {K} is not a multiple of {GROUP}"
    groups = w.view(N, K // GROUP, GROUP)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
    scales = ((hi - lo) / 15).half()
    mins = lo.half()
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round((groups - mins.float().unsqueeze(-1)) / step).clamp_(0, 15).to(torch.uint8)  # [N, G, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)  # [N, G, 16]
    return packed.reshape(N, K // 2).contiguous(), scales, mins


def q4_dequantize(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``unpack_q4`` in one compiled pass over the weight (what prefill runs per call)."""
    return _module().q4_dequantize(packed, scales, mins)


def unpack_q4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a Q4 triple stands for (reference, plain torch)."""
    N = packed.shape[0]
    p = packed.view(N, -1, GROUP // 2)  # [N, G, 16]
    q = torch.cat([p & 15, p >> 4], dim=-1).float()  # [N, G, 32]
    return torch.addcmul(mins.float().unsqueeze(-1), q, scales.float().unsqueeze(-1)).view(N, -1)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q [N, K] int8, scales [N, K/32] fp16); Q8_0's rule ``scale = absmax /
    127``, so a weight from a Q8_0 file is recovered exactly."""
    w = weight.float()
    N, K = w.shape
    assert K % GROUP == 0, f"in_features {K} is not a multiple of {GROUP}"
    groups = w.view(N, K // GROUP, GROUP)
    scales = (groups.abs().amax(dim=-1) / 127).half()  # [N, G]
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny).unsqueeze(-1)
    q = torch.round(groups / step).clamp_(-127, 127).to(torch.int8)
    return q.view(N, K).contiguous(), scales


def unpack_q8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] a Q8 pair stands for."""
    N, K = q.shape
    return (q.view(N, -1, GROUP).float() * scales.float().unsqueeze(-1)).view(N, K)
