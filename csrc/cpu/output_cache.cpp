// The output cache's one instance, and the C functions through which Python reports and
// configures it (mpnb/core/ops/_output_cache.py calls them with ctypes on the loaded library;
// they are not ops: they touch no tensor). See output_cache.h.
#include "cpu/output_cache.h"

#if defined(__linux__)
#include <pthread.h>
#endif

namespace mpnb::cpu {

OutputCache& OutputCache::get() {
  static OutputCache* cache = [] {
    auto* c = new OutputCache();
#if defined(__linux__)
    pthread_atfork(nullptr, nullptr, [] { OutputCache::get().after_fork_child(); });
#endif
    return c;
  }();
  return *cache;
}

}  // namespace mpnb::cpu

extern "C" {

// Writes {limit, held, blocks held, in use, hits, misses, smallest cached output} (bytes and
// counts) to out[0..6].
__attribute__((visibility("default"))) void mpnb_output_cache_stats(int64_t* out) {
  const auto s = mpnb::cpu::OutputCache::get().stats();
  for (size_t i = 0; i < s.size(); ++i) out[i] = s[i];
}

// limit: new limit in bytes (< 0 keeps it); empty != 0 returns every cached block to the OS.
__attribute__((visibility("default"))) void mpnb_output_cache_configure(int64_t limit, int empty) {
  mpnb::cpu::OutputCache::get().configure(limit, empty != 0);
}

}  // extern "C"
