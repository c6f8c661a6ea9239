// Which table of ops.h this CPU runs: the best its features allow, or a lower one named by
// EDGE_ENGINE_ISA (tests and benchmarks compare the paths on one machine).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ops.h"

namespace edge {
namespace {

struct Choice {
  const Ops* ops;
  char note[256];
};

Choice choose() {
  Choice c{&ops_generic(), ""};
  const char* want = std::getenv("EDGE_ENGINE_ISA");
  const char* order[] = {"avx512_vnni", "avxvnni", "avx2", "generic"};
  const Ops* tables[] = {&ops_avx512(), &ops_avxvnni(), &ops_avx2(), &ops_generic()};
  bool skipped_for_env = false;
  for (int i = 0; i < 4; ++i) {
    if (!cpu_has(order[i])) continue;
    if (want && *want && std::strcmp(want, order[i]) != 0) {
      skipped_for_env = true;
      continue;
    }
    c.ops = tables[i];
    break;
  }
  if (skipped_for_env && std::strcmp(c.ops->name, want) == 0)
    std::snprintf(c.note, sizeof c.note, "EDGE_ENGINE_ISA=%s", want);
  else if (want && *want && std::strcmp(c.ops->name, want) != 0)
    std::snprintf(c.note, sizeof c.note, "EDGE_ENGINE_ISA=%s: not available on this CPU", want);
  return c;
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

bool cpu_has(const char* isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                    __builtin_cpu_supports("bmi2");
  if (std::strcmp(isa, "avx2") == 0) return avx2;
  if (std::strcmp(isa, "avxvnni") == 0) return avx2 && __builtin_cpu_supports("avxvnni");
  if (std::strcmp(isa, "avx512_vnni") == 0)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
#endif
  return std::strcmp(isa, "generic") == 0;
}

const Ops& ops() { return *choice().ops; }
const char* ops_note() { return choice().note; }

}  // namespace edge
