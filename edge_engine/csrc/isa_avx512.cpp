// AVX-512 F/BW/VL with VNNI: the hand-written 512-bit tile kernels (float32 FMA, and
// VPDPBUSD for 8-bit activations).
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2")
#define EDGE_NS avx512
#define EDGE_ISA_NAME "avx512_vnni"
#define EDGE_AVX512 1
#include "ops_impl.h"

namespace edge {
const Ops& ops_avx512() { return avx512::kOps; }
}  // namespace edge
#else  // not x86: the portable table stands in
#include "ops.h"
namespace edge {
const Ops& ops_avx512() { return ops_generic(); }
}  // namespace edge
#endif
