// AVX2 with AVX-VNNI (256-bit VPDPBUSD without AVX-512: Intel's Alder Lake and later): as
// isa_avx2.cpp (its float32 tile kernels), the compiler free to use the 8-bit dot products
// in the portable a8 tile kernels.
#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c,bmi2,avxvnni")
#define EDGE_NS avxvnni
#define EDGE_ISA_NAME "avxvnni"
#define EDGE_AVX2 1
#define EDGE_AVXVNNI 1
#include "ops_impl.h"

namespace edge {
const Ops& ops_avxvnni() { return avxvnni::kOps; }
}  // namespace edge
#else  // not x86: the portable table stands in
#include "ops.h"
namespace edge {
const Ops& ops_avxvnni() { return ops_generic(); }
}  // namespace edge
#endif
