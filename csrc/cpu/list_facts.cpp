// mpnb::_list_facts: what the per-tensor checks and the chunk table of a list op need to know
// about its tensor lists, read in one pass (mpnb/core/ops/_checks.py, ListFacts).
//
// A Triton list op checks every tensor (its size against its partner's, its dtype, its layout,
// its device) and keys its chunk table by every tensor's size and address: in Python that is
// one attribute read per tensor per fact, a few hundred nanoseconds each, times thousands of
// tensors on every optimizer step. Here each tensor is read once. Per list the result holds
// flag bits (below) and an id of the list's exact contents (length, then each tensor's numel
// and address): equal ids mean equal contents, since an id is never given to other contents
// (ids only grow; when kMaxIds contents are remembered they are all forgotten and new ids
// follow). The table cache keys on these ids, so a tensor moved, resized or replaced by one at
// another address gives a new id and a new table.
//
// Not an op of the library's table: it reads metadata only and is registered for every
// backend (CompositeImplicitAutograd), since the lists live on the GPU. The names of the
// failing tensors and the messages stay in Python, which runs its own loop on a failed bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace mpnb::cpu {
namespace {

using Tensors = c10::List<at::Tensor>;

// Flag bits per list (mirrored in mpnb/core/ops/_checks.py).
constexpr int64_t kOneDtype = 1;     // every tensor has the first one's dtype
constexpr int64_t kContiguous = 2;   // every tensor is contiguous
constexpr int64_t kPaired = 4;       // as many tensors as list 0, each with its partner's numel
constexpr int64_t kSingles = 8;      // every tensor holds one element
constexpr int64_t kOneDevice = 16;   // every tensor on the device of the first tensor of the call
constexpr int64_t kBelow2e32 = 32;   // every tensor holds fewer than 2^32 elements
constexpr size_t kMaxIds = 1 << 12;  // list contents remembered at once

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& v) const noexcept {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the 64-bit words, then a final mix
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};

class ListIds {
 public:
  // The id of `key` (an exact copy is stored on the first sight only).
  int64_t id_of(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ids_.find(key);
    if (it != ids_.end()) return it->second;
    if (ids_.size() >= kMaxIds) ids_.clear();
    ids_.emplace(key, next_);
    return next_++;
  }

 private:
  std::mutex mu_;
  std::unordered_map<std::vector<int64_t>, int64_t, KeyHash> ids_;
  int64_t next_ = 1;
};

ListIds& list_ids() {
  static ListIds* ids = new ListIds();  // never destroyed: ops may run during interpreter exit
  return *ids;
}

// [flags of each list..., id of each list...] for the (up to eight) lists of one call.
std::vector<int64_t> list_facts(const Tensors& l0, const Tensors& l1, const Tensors& l2,
                                const Tensors& l3, const Tensors& l4, const Tensors& l5,
                                const Tensors& l6, const Tensors& l7) {
  const Tensors* lists[] = {&l0, &l1, &l2, &l3, &l4, &l5, &l6, &l7};
  constexpr size_t n = sizeof(lists) / sizeof(lists[0]);
  std::vector<int64_t> out(2 * n, 0);
  std::optional<at::Device> device;
  thread_local std::vector<int64_t> key;  // reused: a steady call allocates nothing here
  for (size_t j = 0; j < n; ++j) {
    const Tensors& lst = *lists[j];
    const size_t len = lst.size();
    int64_t flags = kOneDtype | kContiguous | kSingles | kOneDevice | kBelow2e32;
    if (len == l0.size()) flags |= kPaired;
    key.clear();
    key.push_back(static_cast<int64_t>(len));
    if (len && !device) device = lst[0].device();
    const auto dtype = len ? lst[0].scalar_type() : at::ScalarType::Undefined;
    for (size_t i = 0; i < len; ++i) {
      const at::Tensor& t = lst[i];
      const int64_t numel = t.numel();
      if (t.scalar_type() != dtype) flags &= ~kOneDtype;
      if (!t.is_contiguous()) flags &= ~kContiguous;
      if (numel != 1) flags &= ~kSingles;
      if (numel >= (int64_t{1} << 32)) flags &= ~kBelow2e32;
      if (t.device() != *device) flags &= ~kOneDevice;
      if (j && (flags & kPaired) && numel != l0[i].numel()) flags &= ~kPaired;
      key.push_back(numel);
      key.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    }
    out[j] = flags;
    out[n + j] = list_ids().id_of(key);
  }
  return out;
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_FRAGMENT(mpnb, m) {
  m.def(
      "_list_facts(Tensor[] l0, Tensor[] l1, Tensor[] l2, Tensor[] l3, Tensor[] l4, "
      "Tensor[] l5, Tensor[] l6, Tensor[] l7) -> int[]",
      &mpnb::cpu::list_facts);
}
