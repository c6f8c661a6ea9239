// The kernels of ops.h for one instruction set: each isa_*.cpp sets the target, defines
// EDGE_NS (its namespace) and some of EDGE_AVX2 / EDGE_AVX512 (hand-written 256/512-bit
// paths), then includes this file.  Without them the loops below are plain C++ that the
// compiler vectorises for the file's target (the portable fallback, and AVX2 / AVX-VNNI
// for the tile kernels).
//
// Only <cstdint> and <immintrin.h> (always-inline intrinsics) are included, and everything
// is static: no function compiled here for one target can stand in for another's.
#include <cstdint>
#if defined(EDGE_AVX2) || defined(EDGE_AVX512)
#include <immintrin.h>
#endif
#include "ops.h"

namespace edge {
namespace EDGE_NS {
namespace {

constexpr int64_t kPanel = 64;  // activation rows kept hot (L2) while a thread's tiles pass

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

inline float h2f(uint16_t h) {  // IEEE half -> float, portable
#if defined(EDGE_AVX2) || defined(EDGE_AVX512)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
#endif
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}

// Rows [m, m + n) handed to KERNEL<MR> in blocks of MAXR, 8, 4, 2, 1 rows.
#define EDGE_ROW_BLOCKS(MAXR, m, n, CALL) \
  do {                                     \
    int64_t _m = (m), _left = (n);         \
    while (_left > 0) {                    \
      if (_left >= MAXR) {                 \
        CALL(MAXR, _m);                    \
        _m += MAXR, _left -= MAXR;         \
      } else if (MAXR > 8 && _left >= 8) { \
        CALL((MAXR > 8 ? 8 : 1), _m);      \
        _m += 8, _left -= 8;               \
      } else if (MAXR > 4 && _left >= 4) { \
        CALL((MAXR > 4 ? 4 : 1), _m);      \
        _m += 4, _left -= 4;               \
      } else if (MAXR > 2 && _left >= 2) { \
        CALL((MAXR > 2 ? 2 : 1), _m);      \
        _m += 2, _left -= 2;               \
      } else {                             \
        CALL(1, _m);                       \
        _m += 1, _left -= 1;               \
      }                                    \
    }                                      \
  } while (0)

// ---- portable tile kernels (16 output rows x MR activation rows) --------------------------
template <int MR>
void q4_f32_tile_c(const float* x, int64_t ldx, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t G = w.K / kGroup;
  float acc[MR][16] = {};
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    float s[16], mn[16];
    for (int n = 0; n < 16; ++n) s[n] = h2f(w.scales[(t * G + g) * 16 + n]), mn[n] = h2f(w.mins[(t * G + g) * 16 + n]);
    const uint8_t* b = base + g * 256;
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {
          float wv[16];
          for (int n = 0; n < 16; ++n) {
            const uint8_t byte = b[c * 64 + n * 4 + j];
            wv[n] = static_cast<float>(h ? byte >> 4 : byte & 15) * s[n] + mn[n];
          }
          const int64_t k = g * kGroup + c * 8 + h * 4 + j;
          for (int r = 0; r < MR; ++r) {
            const float xv = x[r * ldx + k];
            for (int n = 0; n < 16; ++n) acc[r][n] += wv[n] * xv;
          }
        }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < nv; ++n) y[r * ldy + t * 16 + n] = acc[r][n];
}

template <int MR>
void q8_f32_tile_c(const float* x, int64_t ldx, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t G = w.K / kGroup;
  float acc[MR][16] = {};
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    float s[16];
    for (int n = 0; n < 16; ++n) s[n] = h2f(w.scales[(t * G + g) * 16 + n]);
    const uint8_t* b = base + g * 512;
    for (int c = 0; c < 8; ++c)
      for (int j = 0; j < 4; ++j) {
        float wv[16];
        for (int n = 0; n < 16; ++n) wv[n] = static_cast<float>(static_cast<int>(b[c * 64 + n * 4 + j]) - 128) * s[n];
        const int64_t k = g * kGroup + c * 4 + j;
        for (int r = 0; r < MR; ++r) {
          const float xv = x[r * ldx + k];
          for (int n = 0; n < 16; ++n) acc[r][n] += wv[n] * xv;
        }
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < nv; ++n) y[r * ldy + t * 16 + n] = acc[r][n];
}

template <int MR>
void q4_a8_tile_c(const Rows8& x, int64_t m0, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  float acc[MR][16] = {};
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    int32_t ai[MR][16] = {};
    const uint8_t* b = base + g * 256;
    for (int c = 0; c < 4; ++c)
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < MR; ++r) {
          const int8_t* xq = x.q + (m0 + r) * K + g * kGroup + c * 8 + h * 4;
          for (int n = 0; n < 16; ++n) {
            int32_t dot = 0;
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = b[c * 64 + n * 4 + j];
              dot += static_cast<int32_t>(h ? byte >> 4 : byte & 15) * xq[j];
            }
            ai[r][n] += dot;
          }
        }
    for (int r = 0; r < MR; ++r) {
      const float d = x.d[(m0 + r) * G + g], xs = x.xsum[(m0 + r) * G + g];
      for (int n = 0; n < 16; ++n) {
        const float s = h2f(w.scales[(t * G + g) * 16 + n]), mn = h2f(w.mins[(t * G + g) * 16 + n]);
        acc[r][n] += static_cast<float>(ai[r][n]) * (s * d) + mn * xs;
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < nv; ++n) y[(m0 + r) * ldy + t * 16 + n] = acc[r][n];
}

template <int MR>
void q8_a8_tile_c(const Rows8& x, int64_t m0, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  float acc[MR][16] = {};
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    int32_t ai[MR][16] = {};
    const uint8_t* b = base + g * 512;
    for (int c = 0; c < 8; ++c)
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = x.q + (m0 + r) * K + g * kGroup + c * 4;
        for (int n = 0; n < 16; ++n) {
          int32_t dot = 0;
          for (int j = 0; j < 4; ++j) dot += static_cast<int32_t>(b[c * 64 + n * 4 + j]) * xq[j];
          ai[r][n] += dot;
        }
      }
    for (int r = 0; r < MR; ++r) {
      const float d = x.d[(m0 + r) * G + g];
      const int32_t bias = 128 * x.qsum[(m0 + r) * G + g];
      for (int n = 0; n < 16; ++n)
        acc[r][n] += static_cast<float>(ai[r][n] - bias) * (h2f(w.scales[(t * G + g) * 16 + n]) * d);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < nv; ++n) y[(m0 + r) * ldy + t * 16 + n] = acc[r][n];
}

#ifdef EDGE_AVX512
// ---- AVX-512 tile kernels: one zmm = the 16 output rows of a tile -------------------------
inline void store_tile(float* y, __m512 v, int64_t nv) {
  if (nv == 16)
    _mm512_storeu_ps(y, v);
  else
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << nv) - 1), v);
}

// byte j of each dword of v (the j-th of a lane's 4 inputs), as float
template <int J>
inline __m512 byte_lane(__m512i v) {
  const __m512i ff = _mm512_set1_epi32(0xFF);
  if constexpr (J == 0) return _mm512_cvtepi32_ps(_mm512_and_si512(v, ff));
  if constexpr (J == 3) return _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 24));
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 8 * J), ff));
}

template <int MR>
void q4_f32_tile_z(const float* x, int64_t ldx, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  constexpr int P = MR >= 8 ? 1 : 8 / MR;  // independent FMA chains per row (latency)
  const int64_t G = w.K / kGroup;
  __m512 acc[P][MR];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[p][r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (t * G + g) * 16)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + (t * G + g) * 16)));
    const float* xg = x + g * kGroup;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_loadu_si512(base + g * 256 + c * 64);
      const __m512i half[2] = {_mm512_and_si512(b, m4), _mm512_and_si512(_mm512_srli_epi16(b, 4), m4)};
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512 w0 = _mm512_fmadd_ps(byte_lane<0>(half[h]), s, mn);
        const __m512 w1 = _mm512_fmadd_ps(byte_lane<1>(half[h]), s, mn);
        const __m512 w2 = _mm512_fmadd_ps(byte_lane<2>(half[h]), s, mn);
        const __m512 w3 = _mm512_fmadd_ps(byte_lane<3>(half[h]), s, mn);
        const int k = c * 8 + h * 4;
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          const float* xr = xg + r * ldx + k;
          acc[(k + 0) % P][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[0]), acc[(k + 0) % P][r]);
          acc[(k + 1) % P][r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[1]), acc[(k + 1) % P][r]);
          acc[(k + 2) % P][r] = _mm512_fmadd_ps(w2, _mm512_set1_ps(xr[2]), acc[(k + 2) % P][r]);
          acc[(k + 3) % P][r] = _mm512_fmadd_ps(w3, _mm512_set1_ps(xr[3]), acc[(k + 3) % P][r]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    __m512 v = acc[0][r];
#pragma GCC unroll 8
    for (int p = 1; p < P; ++p) v = _mm512_add_ps(v, acc[p][r]);
    store_tile(y + r * ldy + t * 16, v, nv);
  }
}

template <int MR>
void q8_f32_tile_z(const float* x, int64_t ldx, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  constexpr int P = MR >= 8 ? 1 : 8 / MR;
  const int64_t G = w.K / kGroup;
  __m512 acc[P][MR];
#pragma GCC unroll 16
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[p][r] = _mm512_setzero_ps();
  const __m512 bias = _mm512_set1_ps(128.f);
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (t * G + g) * 16)));
    const __m512 sb = _mm512_mul_ps(s, bias);
    const float* xg = x + g * kGroup;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i b = _mm512_loadu_si512(base + g * 512 + c * 64);
      // (q + 128) * s - 128 s: exact (q * s has at most 19 significant bits)
      const __m512 w0 = _mm512_fmsub_ps(byte_lane<0>(b), s, sb);
      const __m512 w1 = _mm512_fmsub_ps(byte_lane<1>(b), s, sb);
      const __m512 w2 = _mm512_fmsub_ps(byte_lane<2>(b), s, sb);
      const __m512 w3 = _mm512_fmsub_ps(byte_lane<3>(b), s, sb);
      const int k = c * 4;
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const float* xr = xg + r * ldx + k;
        acc[(k + 0) % P][r] = _mm512_fmadd_ps(w0, _mm512_set1_ps(xr[0]), acc[(k + 0) % P][r]);
        acc[(k + 1) % P][r] = _mm512_fmadd_ps(w1, _mm512_set1_ps(xr[1]), acc[(k + 1) % P][r]);
        acc[(k + 2) % P][r] = _mm512_fmadd_ps(w2, _mm512_set1_ps(xr[2]), acc[(k + 2) % P][r]);
        acc[(k + 3) % P][r] = _mm512_fmadd_ps(w3, _mm512_set1_ps(xr[3]), acc[(k + 3) % P][r]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    __m512 v = acc[0][r];
#pragma GCC unroll 8
    for (int p = 1; p < P; ++p) v = _mm512_add_ps(v, acc[p][r]);
    store_tile(y + r * ldy + t * 16, v, nv);
  }
}

// VPDPBUSD: unsigned weight nibbles x signed 8-bit activations, 16 rows x 4 inputs a step
template <int MR>
void q4_a8_tile_z(const Rows8& x, int64_t m0, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    __m512i ai[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) ai[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_loadu_si512(base + g * 256 + c * 64);
      const __m512i lo = _mm512_and_si512(b, m4), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = x.q + (m0 + r) * K + g * kGroup + c * 8;
        ai[r] = _mm512_dpbusd_epi32(ai[r], lo, _mm512_set1_epi32(load_i32(xq)));
        ai[r] = _mm512_dpbusd_epi32(ai[r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (t * G + g) * 16)));
    const __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mins + (t * G + g) * 16)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * G + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(s, _mm512_set1_ps(x.d[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.xsum[i]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) store_tile(y + (m0 + r) * ldy + t * 16, acc[r], nv);
}

// Q8 weights stored as q + 128 (unsigned): sum (q + 128) x = sum q x + 128 sum x
template <int MR>
void q8_a8_tile_z(const Rows8& x, int64_t m0, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    __m512i ai[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) ai[r] = _mm512_set1_epi32(-128 * x.qsum[(m0 + r) * G + g]);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i b = _mm512_loadu_si512(base + g * 512 + c * 64);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        ai[r] = _mm512_dpbusd_epi32(ai[r], b, _mm512_set1_epi32(load_i32(x.q + (m0 + r) * K + g * kGroup + c * 4)));
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.scales + (t * G + g) * 16)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ai[r]), _mm512_mul_ps(s, _mm512_set1_ps(x.d[(m0 + r) * G + g])), acc[r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) store_tile(y + (m0 + r) * ldy + t * 16, acc[r], nv);
}
#define EDGE_F32_TILE(kind) kind##_f32_tile_z
#define EDGE_A8_TILE(kind) kind##_a8_tile_z
constexpr int kMaxF32Rows = 16, kMaxA8Rows = 8;
#elif defined(EDGE_AVX2)
// ---- AVX2 tile kernels: two ymm = the 16 output rows of a tile (rows 0-7, 8-15) -----------
// (the compiler does not vectorise the portable loops' strided nibble reads: on an AVX2-only
// CPU they ran a decode step's blocks 5x slower than torch's own int4 matmul)
inline void store_tile(float* y, __m256 lo, __m256 hi, int64_t nv) {
  if (nv == 16) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float tmp[16];
  _mm256_store_ps(tmp, lo);
  _mm256_store_ps(tmp + 8, hi);
  for (int64_t n = 0; n < nv; ++n) y[n] = tmp[n];
}

// byte j of each dword of v (the j-th of a lane's 4 inputs), as float
template <int J>
inline __m256 byte_lane(__m256i v) {
  const __m256i ff = _mm256_set1_epi32(0xFF);
  if constexpr (J == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(v, ff));
  if constexpr (J == 3) return _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 24));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * J), ff));
}

inline __m256 half_floats(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// P independent FMA chains per row and half-tile: zeroed, then summed into the row's tile
template <int P, int MR>
inline void zero_chains(__m256 (&lo)[P][MR], __m256 (&hi)[P][MR]) {
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < MR; ++r) lo[p][r] = hi[p][r] = _mm256_setzero_ps();
}

template <int P, int MR>
inline void store_chains(const __m256 (&lo)[P][MR], const __m256 (&hi)[P][MR], float* y, int64_t ldy, int64_t nv) {
  for (int r = 0; r < MR; ++r) {
    __m256 a = lo[0][r], b = hi[0][r];
    for (int p = 1; p < P; ++p) a = _mm256_add_ps(a, lo[p][r]), b = _mm256_add_ps(b, hi[p][r]);
    store_tile(y + r * ldy, a, b, nv);
  }
}

// input k + J of every row against the 16 weights (lo: rows 0-7, hi: 8-15) of that input
#define EDGE_Y_FMA(J, WLO, WHI)                                                   \
  do {                                                                              \
    const __m256 _wl = (WLO), _wh = (WHI);                                          \
    _Pragma("GCC unroll 4") for (int r = 0; r < MR; ++r) {                          \
      const __m256 _x = _mm256_set1_ps(xg[r * ldx + k + (J)]);                      \
      lo[(k + (J)) % P][r] = _mm256_fmadd_ps(_wl, _x, lo[(k + (J)) % P][r]);        \
      hi[(k + (J)) % P][r] = _mm256_fmadd_ps(_wh, _x, hi[(k + (J)) % P][r]);        \
    }                                                                               \
  } while (0)

template <int MR>
void q4_f32_tile_y(const float* x, int64_t ldx, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  constexpr int P = MR >= 4 ? 1 : 4 / MR;  // independent FMA chains per row (latency)
  const int64_t G = w.K / kGroup;
  __m256 lo[P][MR], hi[P][MR];
  zero_chains(lo, hi);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* sp = w.scales + (t * G + g) * 16;
    const uint16_t* mp = w.mins + (t * G + g) * 16;
    const __m256 s0 = half_floats(sp), s1 = half_floats(sp + 8), n0 = half_floats(mp), n1 = half_floats(mp + 8);
    const float* xg = x + g * kGroup;
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 256 + c * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 256 + c * 64 + 32));
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i q0 = h ? _mm256_and_si256(_mm256_srli_epi16(b0, 4), m4) : _mm256_and_si256(b0, m4);
        const __m256i q1 = h ? _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4) : _mm256_and_si256(b1, m4);
        const int k = c * 8 + h * 4;
        EDGE_Y_FMA(0, _mm256_fmadd_ps(byte_lane<0>(q0), s0, n0), _mm256_fmadd_ps(byte_lane<0>(q1), s1, n1));
        EDGE_Y_FMA(1, _mm256_fmadd_ps(byte_lane<1>(q0), s0, n0), _mm256_fmadd_ps(byte_lane<1>(q1), s1, n1));
        EDGE_Y_FMA(2, _mm256_fmadd_ps(byte_lane<2>(q0), s0, n0), _mm256_fmadd_ps(byte_lane<2>(q1), s1, n1));
        EDGE_Y_FMA(3, _mm256_fmadd_ps(byte_lane<3>(q0), s0, n0), _mm256_fmadd_ps(byte_lane<3>(q1), s1, n1));
      }
    }
  }
  store_chains(lo, hi, y + t * 16, ldy, nv);
}

template <int MR>
void q8_f32_tile_y(const float* x, int64_t ldx, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  constexpr int P = MR >= 4 ? 1 : 4 / MR;
  const int64_t G = w.K / kGroup;
  __m256 lo[P][MR], hi[P][MR];
  zero_chains(lo, hi);
  const __m256 bias = _mm256_set1_ps(128.f);
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    const uint16_t* sp = w.scales + (t * G + g) * 16;
    const __m256 s0 = half_floats(sp), s1 = half_floats(sp + 8);
    const __m256 sb0 = _mm256_mul_ps(s0, bias), sb1 = _mm256_mul_ps(s1, bias);
    const float* xg = x + g * kGroup;
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 512 + c * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 512 + c * 64 + 32));
      const int k = c * 4;
      // (q + 128) * s - 128 s: exact (q * s has at most 19 significant bits)
      EDGE_Y_FMA(0, _mm256_fmsub_ps(byte_lane<0>(b0), s0, sb0), _mm256_fmsub_ps(byte_lane<0>(b1), s1, sb1));
      EDGE_Y_FMA(1, _mm256_fmsub_ps(byte_lane<1>(b0), s0, sb0), _mm256_fmsub_ps(byte_lane<1>(b1), s1, sb1));
      EDGE_Y_FMA(2, _mm256_fmsub_ps(byte_lane<2>(b0), s0, sb0), _mm256_fmsub_ps(byte_lane<2>(b1), s1, sb1));
      EDGE_Y_FMA(3, _mm256_fmsub_ps(byte_lane<3>(b0), s0, sb0), _mm256_fmsub_ps(byte_lane<3>(b1), s1, sb1));
    }
  }
  store_chains(lo, hi, y + t * 16, ldy, nv);
}
#undef EDGE_Y_FMA

// VPMADDUBSW: unsigned weight nibbles x signed 8-bit activations, pairs summed in 16 bits;
// a group's 16 products per lane stay within int16 (16 x 15 x 127 = 30,480), so exact
template <int MR>
void q4_a8_tile_y(const Rows8& x, int64_t m0, const Q4& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* base = w.packed + t * G * 256;
  for (int64_t g = 0; g < G; ++g) {
    __m256i a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 256 + c * 64));
      const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 256 + c * 64 + 32));
      const __m256i l0 = _mm256_and_si256(b0, m4), h0 = _mm256_and_si256(_mm256_srli_epi16(b0, 4), m4);
      const __m256i l1 = _mm256_and_si256(b1, m4), h1 = _mm256_and_si256(_mm256_srli_epi16(b1, 4), m4);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = x.q + (m0 + r) * K + g * kGroup + c * 8;
        const __m256i xl = _mm256_set1_epi32(load_i32(xq)), xh = _mm256_set1_epi32(load_i32(xq + 4));
        a0[r] = _mm256_add_epi16(a0[r], _mm256_add_epi16(_mm256_maddubs_epi16(l0, xl), _mm256_maddubs_epi16(h0, xh)));
        a1[r] = _mm256_add_epi16(a1[r], _mm256_add_epi16(_mm256_maddubs_epi16(l1, xl), _mm256_maddubs_epi16(h1, xh)));
      }
    }
    const uint16_t* sp = w.scales + (t * G + g) * 16;
    const uint16_t* mp = w.mins + (t * G + g) * 16;
    const __m256 s0 = half_floats(sp), s1 = half_floats(sp + 8), n0 = half_floats(mp), n1 = half_floats(mp + 8);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * G + g;
      const __m256 d = _mm256_set1_ps(x.d[i]), xs = _mm256_set1_ps(x.xsum[i]);
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a0[r], ones)), _mm256_mul_ps(s0, d), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(a1[r], ones)), _mm256_mul_ps(s1, d), acc1[r]);
      acc0[r] = _mm256_fmadd_ps(n0, xs, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(n1, xs, acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) store_tile(y + (m0 + r) * ldy + t * 16, acc0[r], acc1[r], nv);
}

// Q8 weights stored as q + 128 with |q| <= 127 (pack_q8 clamps): q x = |x| (q sign(x)), the
// unsigned-by-signed product VPMADDUBSW takes; a pair's sum is at most 2 x 127 x 127, exact
template <int MR>
void q8_a8_tile_y(const Rows8& x, int64_t m0, const Q8& w, int64_t t, float* y, int64_t ldy, int64_t nv) {
  const int64_t K = w.K, G = K / kGroup;
  __m256 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* base = w.q + t * G * 512;
  for (int64_t g = 0; g < G; ++g) {
    __m256i a0[MR], a1[MR];
    for (int r = 0; r < MR; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 512 + c * 64)), flip);
      const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + g * 512 + c * 64 + 32)), flip);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m256i xb = _mm256_set1_epi32(load_i32(x.q + (m0 + r) * K + g * kGroup + c * 4));
        const __m256i ax = _mm256_abs_epi8(xb);
        a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q0, xb)), ones));
        a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(q1, xb)), ones));
      }
    }
    const uint16_t* sp = w.scales + (t * G + g) * 16;
    const __m256 s0 = half_floats(sp), s1 = half_floats(sp + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 d = _mm256_set1_ps(x.d[(m0 + r) * G + g]);
      acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a0[r]), _mm256_mul_ps(s0, d), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a1[r]), _mm256_mul_ps(s1, d), acc1[r]);
    }
  }
  for (int r = 0; r < MR; ++r) store_tile(y + (m0 + r) * ldy + t * 16, acc0[r], acc1[r], nv);
}
#define EDGE_F32_TILE(kind) kind##_f32_tile_y
#ifdef EDGE_AVXVNNI  // the portable a8 loops, which the compiler turns into 256-bit VPDPBUSD
#define EDGE_A8_TILE(kind) kind##_a8_tile_c
#else
#define EDGE_A8_TILE(kind) kind##_a8_tile_y
#endif
constexpr int kMaxF32Rows = 4, kMaxA8Rows = 4;
#else
#define EDGE_F32_TILE(kind) kind##_f32_tile_c
#define EDGE_A8_TILE(kind) kind##_a8_tile_c
constexpr int kMaxF32Rows = 4, kMaxA8Rows = 4;
#endif

// ---- the table's entries: panels of rows, a thread's tiles -------------------------------
void q4_f32(const float* x, int64_t ldx, int64_t M, const Q4& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = imin(kPanel, M - p0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nv = imin(kTile, w.N - t * kTile);
#define EDGE_CALL(R, m) EDGE_F32_TILE(q4)<R>(x + (m) * ldx, ldx, w, t, y + (m) * ldy, ldy, nv)
      EDGE_ROW_BLOCKS(kMaxF32Rows, p0, rows, EDGE_CALL);
#undef EDGE_CALL
    }
  }
}

void q8_f32(const float* x, int64_t ldx, int64_t M, const Q8& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = imin(kPanel, M - p0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nv = imin(kTile, w.N - t * kTile);
#define EDGE_CALL(R, m) EDGE_F32_TILE(q8)<R>(x + (m) * ldx, ldx, w, t, y + (m) * ldy, ldy, nv)
      EDGE_ROW_BLOCKS(kMaxF32Rows, p0, rows, EDGE_CALL);
#undef EDGE_CALL
    }
  }
}

void q4_a8(const Rows8& x, int64_t M, const Q4& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = imin(kPanel, M - p0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nv = imin(kTile, w.N - t * kTile);
#define EDGE_CALL(R, m) EDGE_A8_TILE(q4)<R>(x, m, w, t, y, ldy, nv)
      EDGE_ROW_BLOCKS(kMaxA8Rows, p0, rows, EDGE_CALL);
#undef EDGE_CALL
    }
  }
}

void q8_a8(const Rows8& x, int64_t M, const Q8& w, int64_t t0, int64_t t1, float* y, int64_t ldy) {
  for (int64_t p0 = 0; p0 < M; p0 += kPanel) {
    const int64_t rows = imin(kPanel, M - p0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nv = imin(kTile, w.N - t * kTile);
#define EDGE_CALL(R, m) EDGE_A8_TILE(q8)<R>(x, m, w, t, y, ldy, nv)
      EDGE_ROW_BLOCKS(kMaxA8Rows, p0, rows, EDGE_CALL);
#undef EDGE_CALL
    }
  }
}

// q = round(x / d), d = max|x| / 127 per group of 32 (round to nearest even, as VCVTPS2DQ)
void quantize_rows(const float* x, int64_t ldx, int64_t m0, int64_t m1, const Rows8& out) {
  const int64_t K = out.K, G = K / kGroup;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * ldx + g * kGroup;
      int8_t* q = out.q + m * K + g * kGroup;
      float amax = 0.f, sum = 0.f;
      for (int k = 0; k < kGroup; ++k) {
        const float a = xg[k] < 0 ? -xg[k] : xg[k];
        amax = a > amax ? a : amax;
        sum += xg[k];
      }
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t qsum = 0;
      for (int k = 0; k < kGroup; ++k) {
        const int32_t v = static_cast<int32_t>(__builtin_rintf(xg[k] * inv));
        q[k] = static_cast<int8_t>(v);
        qsum += v;
      }
      out.d[m * G + g] = d;
      out.xsum[m * G + g] = sum;
      out.qsum[m * G + g] = qsum;
    }
}

// ---- the decode step's pieces -------------------------------------------------------------
#if defined(EDGE_AVX2) || defined(EDGE_AVX512)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// x[i] = exp(x[i]): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial
// (relative error ~1e-7, float32's own).  Softmax and SiLU need ~10^6 of these per step.
void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#if defined(EDGE_AVX2) || defined(EDGE_AVX512)
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
  for (; i < n; ++i) x[i] = __builtin_expf(x[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void rms_norm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  const float ms = dot(x, x, n) / static_cast<float>(n);
  const float r = 1.f / __builtin_sqrtf(ms + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * r * weight[i];
}

// One query head over its paged context: out = softmax(q . K^T * scale) V.  K and V rows of
// token t sit at (table[t / bs] * bs + t % bs) * slot_stride + kv_offset.
void attend(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t bs, int64_t slot_stride,
            int64_t kv_offset, int64_t C, int64_t D, float scale, float* s, float* out) {
#if defined(EDGE_AVX2) || defined(EDGE_AVX512)
  if (D == 64) {
    __m256 qv[8];
    for (int c = 0; c < 8; ++c) qv[c] = _mm256_mul_ps(_mm256_loadu_ps(q + 8 * c), _mm256_set1_ps(scale));
    float mx = -__builtin_inff();
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
      mx = s[t] > mx ? s[t] : mx;
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
  float mx = -__builtin_inff();
  for (int64_t t = 0; t < C; ++t) {
    const float* k = kc + (table[t / bs] * bs + t % bs) * slot_stride + kv_offset;
    s[t] = dot(q, k, D) * scale;
    mx = s[t] > mx ? s[t] : mx;
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

}  // namespace

const Ops kOps = {EDGE_ISA_NAME, q4_f32, q8_f32, q4_a8, q8_a8, quantize_rows, exp_inplace, rms_norm, attend};

}  // namespace EDGE_NS
}  // namespace edge
