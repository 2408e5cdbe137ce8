// Multi-tensor apply on the CPU: one call walks a table of (tensor, offset, length) chunks in
// parallel. Thousands of small tensors cost one dispatch, not one per tensor; a few huge
// tensors are cut into chunks so that every thread gets an equal share.
//
// The chunk grid depends only on the tensor sizes (never on the thread count), so reductions
// that combine per-chunk partials in chunk order give the same bits on any number of threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <optional>
#include <vector>

#include "cpu/vec_io.h"

namespace mpnb::cpu {

// A `Tensor[]` argument as the dispatcher hands it over: the boxed call's list itself, read
// in place (`list[i]` is a `const at::Tensor&`; no per-tensor copy or refcount change).
// The helpers below take any list type with size() and operator[] (also at::TensorList).
using Tensors = c10::List<at::Tensor>;

// Elements per chunk: 3 lists of fp32 chunks (in, out, state) stay inside a 1 MiB L2 share.
constexpr int64_t kChunkElems = 1 << 15;
// Below this many elements in total the call stays on one thread: the serial work is tens of
// microseconds, and a parallel region costs a few microseconds on a quiet machine but a whole
// scheduler slice (milliseconds) when another process holds a core.
constexpr int64_t kSerialElems = 1 << 17;

struct Chunk {
  int64_t tensor;  // index into the tensor lists
  int64_t offset;  // first element of this chunk
  int64_t len;     // number of elements
};

struct ChunkTable {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk;  // first chunk index of each tensor (size ntensors + 1)
  int64_t numel = 0;
};

// `skip` (optional, one flag per tensor): tensors flagged nonzero get no chunks (an op that
// hands them to another kernel); their first_chunk entry equals the next tensor's.
template <class L>
inline ChunkTable make_chunks(const L& tensors, int64_t chunk = kChunkElems,
                              const std::vector<char>* skip = nullptr) {
  ChunkTable t;
  t.first_chunk.reserve(tensors.size() + 1);
  auto skipped = [&](size_t i) { return skip != nullptr && (*skip)[i] != 0; };
  int64_t count = 0;
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!skipped(i)) count += (tensors[i].numel() + chunk - 1) / chunk;
  t.chunks.reserve(count);
  for (int64_t i = 0; i < static_cast<int64_t>(tensors.size()); ++i) {
    t.first_chunk.push_back(static_cast<int64_t>(t.chunks.size()));
    if (skipped(static_cast<size_t>(i))) continue;
    const int64_t n = tensors[i].numel();
    t.numel += n;
    for (int64_t off = 0; off < n; off += chunk) t.chunks.push_back({i, off, std::min(chunk, n - off)});
  }
  t.first_chunk.push_back(static_cast<int64_t>(t.chunks.size()));
  return t;
}

// Call fn(chunk_index, chunk) for every chunk, in parallel when the work is worth it.
template <typename F>
inline void for_each_chunk(const ChunkTable& table, const F& fn) {
  const int64_t n = static_cast<int64_t>(table.chunks.size());
  if (n == 0) return;
  if (table.numel < kSerialElems || n == 1 || at::get_num_threads() == 1) {
    for (int64_t c = 0; c < n; ++c) fn(c, table.chunks[c]);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) fn(c, table.chunks[c]);
  });
}

// ---- memory guards shared by every multi-tensor op ---------------------------------------
// The arguments were checked once, in Python, by the op's check (mpnb/core/ops/_library.py),
// whose messages name the problem and the fix; the wrapper shows that message when a kernel
// refuses a call. These guards only keep a direct torch.ops.mpnb call from reading or writing
// out of bounds: short messages, ValueError / TypeError as the checks raise.

template <class L>
inline void check_list(const L& list, const char* op, const char* what, int64_t n) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(list.size()) == n, op, ": list length of ", what);
  if (list.empty()) return;
  const auto dtype = list[0].scalar_type();
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& t = list[i];
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), op, ": ", what, "[", i,
                      "] is not a contiguous CPU tensor");
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": dtype of ", what, "[", i, "]");
  }
}

template <class A, class B>
inline void check_same_sizes(const A& a, const B& b, const char* op, const char* what) {
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK_VALUE(a[i].numel() == b[i].numel(), op, ": size of ", what, "[", i, "]");
}

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

template <class L>
inline void check_float(const L& list, const char* op, const char* what) {
  if (list.empty()) return;
  const auto t = list[0].scalar_type();
  TORCH_CHECK_TYPE(is_float_type(t), op, ": dtype of ", what);
}

// Set a flag tensor (any dtype) to 1.
inline void raise_flag(const at::Tensor& flag) { flag.fill_(1); }

// The value of an optional one-element tensor (1.0 when absent).
inline double scalar_of(const std::optional<at::Tensor>& t, const char* op, const char* what) {
  if (!t.has_value()) return 1.0;
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": ", what, " must hold one value");
  return t->item<double>();
}

}  // namespace mpnb::cpu
