// The portable tables: plain C++ for the build's baseline target.
#define EDGE_NS generic
#define EDGE_ISA_NAME "generic"
#include "ops_impl.h"

namespace edge {
const Ops& ops_generic() { return generic::kOps; }
}  // namespace edge
