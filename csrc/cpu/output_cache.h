// The output cache of the layer kernels: large outputs (16 MiB and more) are taken from memory
// that earlier outputs of the same rounded size gave back, instead of from a fresh mmap.
//
// Why: with glibc's default allocator every allocation of 32 MiB or more is a fresh mmap, and
// the OS zeroes each of its pages on the kernel's first write (measured, 1 thread, 64 MiB
// outputs: x.clone() of the output reaches 23-26% of the same-run in-place add, the norms,
// softmax and RoPE 24-44%; into reused memory the same kernels reach 42-82%). PyTorch's CUDA
// caching allocator keeps freed blocks for the same reason; its CPU allocator does not.
//
// How: a c10::Allocator whose blocks are mapped fresh from the OS, 2 MiB aligned, with
// transparent huge pages advised before their first write (map_block), and whose deleter
// puts a block back on a free list, most recent last, as long as the blocks held there stay
// within the limit (oldest freed first to make room). A request takes the most recent free
// block of exactly its rounded size (2 MiB granularity). Requests below 16 MiB and everything past the limit go to malloc/free as before. Tensors
// keep a resizable storage with this allocator, so resize_() and the rest work as usual.
//
// The limit (bytes held in free blocks, not in use) is MPNB_CPU_OUTPUT_CACHE_MB (default 1024;
// 0 turns the cache off), read when the cache is first used; mpnb.core.ops.output_cache()
// reports and changes it, and empties the cache (mpnb/core/ops/_output_cache.py, through the
// C functions at the end of this file).
#pragma once

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>

#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <mutex>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mpnb::cpu {

constexpr size_t kCacheMinBytes = size_t(16) << 20;  // smaller outputs: malloc reuses them already
constexpr size_t kCacheGrain = size_t(2) << 20;      // block sizes and alignment: one huge page
constexpr size_t kCacheDefaultMiB = 1024;            // the limit unless MPNB_CPU_OUTPUT_CACHE_MB

// Whether an output of nbytes comes from the cache (the layer kernels ask before allocating).
inline bool cacheable(size_t nbytes) { return nbytes >= kCacheMinBytes; }

class OutputCache final : public c10::Allocator {
 public:
  // The one cache of the process (output_cache.cpp); never destroyed, so tensors freed during
  // interpreter shutdown still find it.
  static OutputCache& get();

  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    if (cacheable(n) && limit_.load(std::memory_order_relaxed) > 0) {
      const size_t size = (n + kCacheGrain - 1) / kCacheGrain * kCacheGrain;
      {
        std::lock_guard<std::mutex> g(mu_);
        for (size_t i = free_.size(); i-- > 0;) {
          if (free_[i].size == size) {
            p = free_[i].ptr;
            held_ -= size;
            free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
            ++hits_;
            break;
          }
        }
        if (!p) ++misses_;
      }
      if (!p) {
        p = map_block(size);
        TORCH_CHECK(p, "mpnb: out of memory allocating ", size,
                    " bytes for a kernel's output; free tensors or call "
                    "mpnb.core.ops.output_cache(empty=True) to return cached blocks");
      }
      std::lock_guard<std::mutex> g(mu_);
      live_[p] = size;
    } else {
      p = c10::alloc_cpu(n);
    }
    return {p, p, &OutputCache::release, at::Device(at::kCPU)};
  }

  // A child forked while another thread held the lock would wait on it forever: it gets a
  // fresh one (the free list and the sizes are the child's own copies, still right).
  void after_fork_child() { new (&mu_) std::mutex(); }

  c10::DeleterFnPtr raw_deleter() const override { return &OutputCache::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // {limit, held, blocks held, in use (bytes of live cached-size outputs), hits, misses,
  //  smallest cached output}
  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> g(mu_);
    int64_t live = 0;
    for (const auto& kv : live_) live += static_cast<int64_t>(kv.second);
    return {static_cast<int64_t>(limit_.load()), static_cast<int64_t>(held_), static_cast<int64_t>(free_.size()),
            live, hits_, misses_, static_cast<int64_t>(kCacheMinBytes)};
  }

  // A new limit (bytes; < 0 keeps it); empty: give every free block back to the OS.
  void configure(int64_t limit, bool empty) {
    std::vector<Block> drop;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (limit >= 0) limit_ = static_cast<size_t>(limit);
      limit_trim(empty ? 0 : limit_.load(), drop);
    }
    for (const auto& b : drop) unmap_block(b.ptr, b.size);
  }

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  // A fresh block of `size` bytes (a multiple of kCacheGrain) at a 2 MiB-aligned address,
  // straight from mmap with huge pages advised before its first write: never memory that
  // malloc recycled (posix_memalign may hand back heap pages already backed by small pages,
  // which the advice does not replace; seen in a long test process). nullptr when refused.
  static void* map_block(size_t size) {
#if defined(__linux__)
    const size_t span = size + kCacheGrain;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t a = (r + kCacheGrain - 1) & ~(uintptr_t(kCacheGrain) - 1);
    if (a > r) munmap(raw, a - r);  // the unaligned head and tail go back at once
    if (r + span > a + size) munmap(reinterpret_cast<void*>(a + size), r + span - (a + size));
#if defined(MADV_HUGEPAGE)
    (void)madvise(reinterpret_cast<void*>(a), size, MADV_HUGEPAGE);
#endif
    return reinterpret_cast<void*>(a);
#else
    void* p = nullptr;
    return posix_memalign(&p, kCacheGrain, size) == 0 ? p : nullptr;
#endif
  }

  static void unmap_block(void* p, size_t size) {
#if defined(__linux__)
    munmap(p, size);
#else
    (void)size;
    std::free(p);
#endif
  }

  // The limit from MPNB_CPU_OUTPUT_CACHE_MB: digits only (what env_problem in
  // _output_cache.py accepts), anything else keeps the default.
  OutputCache() {
    const char* env = std::getenv("MPNB_CPU_OUTPUT_CACHE_MB");
    size_t mb = kCacheDefaultMiB;
    if (env && *env && std::strspn(env, "0123456789") == std::strlen(env) && std::strlen(env) < 12) {
      mb = static_cast<size_t>(std::strtoull(env, nullptr, 10));
    }
    limit_ = mb << 20;
  }

  // Free the oldest blocks until at most `keep` bytes are held (mu_ held; freed by the caller).
  void limit_trim(size_t keep, std::vector<Block>& drop) {
    size_t n = 0;
    while (n < free_.size() && held_ > keep) {
      held_ -= free_[n].size;
      drop.push_back(free_[n++]);
    }
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
  }

  static void release(void* p) {
    if (!p) return;
    OutputCache& c = get();
    std::vector<Block> drop;
    bool cached = false, ours = false;
    size_t size = 0;
    {
      std::lock_guard<std::mutex> g(c.mu_);
      auto it = c.live_.find(p);
      if (it != c.live_.end()) {
        ours = true;
        size = it->second;
        c.live_.erase(it);
        const size_t limit = c.limit_.load();
        if (size <= limit) {
          c.limit_trim(limit - size, drop);
          c.free_.push_back({p, size});
          c.held_ += size;
          cached = true;
        }
      }
    }
    for (const auto& b : drop) unmap_block(b.ptr, b.size);
    if (!ours) c10::free_cpu(p);
    else if (!cached) unmap_block(p, size);
  }

  std::mutex mu_;
  std::vector<Block> free_;                    // most recently freed last
  std::unordered_map<void*, size_t> live_;     // cached-size blocks in use, with their sizes
  std::atomic<size_t> limit_{0};
  size_t held_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// An empty CPU tensor from the output cache, contiguous, or with the given strides.
inline at::Tensor cached_empty(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  return at::detail::empty_generic(sizes, &OutputCache::get(), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(opts.dtype()), at::MemoryFormat::Contiguous);
}

inline at::Tensor cached_empty_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                       const at::TensorOptions& opts) {
  return at::detail::empty_strided_generic(sizes, strides, &OutputCache::get(),
                                           c10::DispatchKeySet(c10::DispatchKey::CPU),
                                           c10::typeMetaToScalarType(opts.dtype()));
}

}  // namespace mpnb::cpu
