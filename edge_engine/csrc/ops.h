// The compute kernels behind edge_engine.kernels, one table of them per instruction set.
//
// Nothing here includes torch: each isa_*.cpp compiles ops_impl.h for one target (GCC's
// `#pragma GCC target`), and a header with inline functions shared between such files would
// let the linker keep an AVX-512 copy for everyone.  kernels.cpp (torch, threads, Python)
// calls these through `edge::ops()`, picked at load time from the CPU's features.
//
// Weight layouts (built by edge_engine/kernels.py), tiles of 16 output rows ("n"):
//  Q4 (llama.cpp's Q4_1 grid, w = q * scale + min, q in 0..15, one group per 32 inputs):
//    packed [T, G, 4, 64] uint8: chunk c, byte 4 n + j: low nibble q[n][32 g + 8 c + j],
//    high nibble q[n][32 g + 8 c + 4 + j]; scales, mins [T, G, 16] fp16.
//  Q8 (llama.cpp's Q8_0 grid, w = q * scale, q in -127..127):
//    q [T, G, 8, 64] uint8 holding q + 128: chunk c, byte 4 n + j: q[n][32 g + 4 c + j];
//    scales [T, G, 16] fp16.
//  (T = ceil(N / 16) tiles; rows past N are zero.)  One 64-byte chunk is 16 output rows x 4
//  (Q8) or 2 x 4 (Q4) inputs: the shape of one 512-bit integer dot product (VPDPBUSD), and
//  each unpacked chunk is reused by every activation row of the call.
//
// Activations: float32 rows (exact arithmetic on the weights' own values), or rows quantised
// to 8 bits per group of 32 (`Rows8`: q = round(x / d), d = max|x| / 127; the sum of the
// group's float inputs for Q4_1's min term; the sum of q for the Q8 bias), llama.cpp's
// Q8_1-like activations, which the integer dot products take.
#pragma once
#include <cstdint>

namespace edge {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 16;

struct Q4 {
  const uint8_t* packed;
  const uint16_t* scales;  // fp16 bits
  const uint16_t* mins;
  int64_t N, K;
  int64_t tiles() const { return (N + kTile - 1) / kTile; }
};

struct Q8 {
  const uint8_t* q;  // q + 128
  const uint16_t* scales;
  int64_t N, K;
  int64_t tiles() const { return (N + kTile - 1) / kTile; }
};

struct Rows8 {  // M rows of K inputs, 8-bit per group of 32
  int8_t* q;       // [M, K]
  float* d;        // [M, G]
  float* xsum;     // [M, G]: sum of the group's float inputs
  int32_t* qsum;   // [M, G]: sum of the group's q
  int64_t K;
};

struct Ops {
  const char* name;
  // y[m, n] (+ ldy) for tiles [t0, t1) and rows [0, M): float32 activations x (ldx)
  void (*q4_f32)(const float* x, int64_t ldx, int64_t M, const Q4& w, int64_t t0, int64_t t1, float* y, int64_t ldy);
  void (*q8_f32)(const float* x, int64_t ldx, int64_t M, const Q8& w, int64_t t0, int64_t t1, float* y, int64_t ldy);
  // the same from 8-bit rows (integer dot products)
  void (*q4_a8)(const Rows8& x, int64_t M, const Q4& w, int64_t t0, int64_t t1, float* y, int64_t ldy);
  void (*q8_a8)(const Rows8& x, int64_t M, const Q8& w, int64_t t0, int64_t t1, float* y, int64_t ldy);
  // rows [m0, m1) of x (ldx) into 8-bit rows
  void (*quantize_rows)(const float* x, int64_t ldx, int64_t m0, int64_t m1, const Rows8& out);
  // the decode step's pieces
  void (*exp_inplace)(float* x, int64_t n);
  void (*rms_norm)(const float* x, const float* weight, float* out, int64_t n, float eps);
  void (*attend)(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t bs, int64_t slot_stride,
                 int64_t kv_offset, int64_t C, int64_t D, float scale, float* s, float* out);
};

const Ops& ops_generic();
const Ops& ops_avx2();
const Ops& ops_avxvnni();
const Ops& ops_avx512();

// The best table this CPU runs (or the one EDGE_ENGINE_ISA names: generic | avx2 | avxvnni |
// avx512, if the CPU has it); chosen once.
const Ops& ops();
// Why each table above the chosen one was not taken ("" when the best one was).
const char* ops_note();
bool cpu_has(const char* isa);

}  // namespace edge
