// AVX2 + FMA + F16C (x86-64-v3): hand-written 256-bit tile kernels (float32 FMA, and
// VPMADDUBSW for 8-bit activations), attention and exp.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c,bmi2")
#define EDGE_NS avx2
#define EDGE_ISA_NAME "avx2"
#define EDGE_AVX2 1
#include "ops_impl.h"

namespace edge {
const Ops& ops_avx2() { return avx2::kOps; }
}  // namespace edge
#else  // not x86: the portable table stands in
#include "ops.h"
namespace edge {
const Ops& ops_avx2() { return ops_generic(); }
}  // namespace edge
#endif
