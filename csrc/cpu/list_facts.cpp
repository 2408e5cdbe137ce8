// mpnb_list_facts: what the per-tensor checks and the chunk table of a list op need to know
// about its tensor lists, read in one pass (mpnb/core/ops/triton/_checks.py, list_facts).
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
// Not an op: it reads metadata only, on tensors of any device, and is called by the Triton
// launchers from inside their op's kernel. It is a plain C function of the library taking the
// Python lists as they are (mpnb/core/ops/triton/_checks.py calls it through ctypes): an op
// would send every tensor through the dispatcher's argument stack a second time, which cost
// 100 us per AdamW step of 76 parameters against 3.5 us for this pass. The names of the
// failing tensors and the messages stay in Python, which runs its own loop on a failed bit.
// Built only where Python's headers are found; without them the launchers read the facts in
// Python.
#if __has_include(<Python.h>)
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace mpnb::cpu {
namespace {

// Flag bits per list (mirrored in mpnb/core/ops/_checks.py).
constexpr int64_t kOneDtype = 1;     // every tensor has the first one's dtype
constexpr int64_t kContiguous = 2;   // every tensor is contiguous
constexpr int64_t kPaired = 4;       // as many tensors as list 0, each with its partner's numel
constexpr int64_t kSingles = 8;      // every tensor holds one element
constexpr int64_t kOneDevice = 16;   // every tensor on the device of the first tensor of the call
constexpr int64_t kBelow2e32 = 32;   // every tensor holds fewer than 2^32 elements
constexpr size_t kMaxIds = 1 << 12;  // list contents remembered at once
constexpr size_t kMaxLists = 8;     // lists per call (mirrored in _checks.py)

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

// One Python sequence of tensors as read by PySequence_Fast (a list is itself, no copy),
// released when the pass leaves it.
struct Held {
  PyObject* seq = nullptr;
  ~Held() { Py_XDECREF(seq); }
};

// Sets a Python error and returns false (the caller returns nullptr to Python).
bool fail(PyObject* type, const char* what) {
  PyErr_SetString(type, what);
  return false;
}

// [flags of each list..., id of each list...] for the lists of one call (kMaxLists slots, the
// missing lists empty), each tensor read once, straight from its Python object: its facts,
// its numel and address into the list's key. False with a Python error set for anything but
// plain tensors; a c10::Error (a tensor without storage) propagates to the caller.
bool read_facts(PyObject* outer, Py_ssize_t n, int64_t* out) {
  thread_local std::vector<int64_t> key;     // reused: a steady call allocates nothing here
  thread_local std::vector<int64_t> numels0;  // list 0's element counts (its partners')
  std::optional<at::Device> device;
  size_t len0 = 0;
  numels0.clear();
  for (size_t j = 0; j < kMaxLists; ++j) {
    Held held;
    PyObject** items = nullptr;
    size_t len = 0;
    if (static_cast<Py_ssize_t>(j) < n) {
      held.seq = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, j), "a list of tensors");
      if (!held.seq) return false;
      len = static_cast<size_t>(PySequence_Fast_GET_SIZE(held.seq));
      items = PySequence_Fast_ITEMS(held.seq);
    }
    if (j == 0) len0 = len;
    int64_t flags = kOneDtype | kContiguous | kSingles | kOneDevice | kBelow2e32;
    if (len == len0) flags |= kPaired;
    key.clear();
    key.push_back(static_cast<int64_t>(len));
    caffe2::TypeMeta dtype;
    for (size_t i = 0; i < len; ++i) {
      if (!THPVariable_Check(items[i])) {
        return fail(PyExc_TypeError, "mpnb_list_facts: a list holds a non-tensor");
      }
      const at::Tensor& t = THPVariable_Unpack(items[i]);
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (impl->is_python_dispatch()) {
        return fail(PyExc_TypeError, "mpnb_list_facts: a tensor subclass dispatches in Python");
      }
      const int64_t numel = impl->numel();
      const caffe2::TypeMeta st = impl->dtype();
      const at::Device dev = impl->device();
      if (i == 0) {
        dtype = st;
        if (!device) device = dev;
      }
      if (st != dtype) flags &= ~kOneDtype;
      if (!impl->is_contiguous()) flags &= ~kContiguous;
      if (numel != 1) flags &= ~kSingles;
      if (numel >= (int64_t{1} << 32)) flags &= ~kBelow2e32;
      if (dev != *device) flags &= ~kOneDevice;
      if (j == 0) {
        numels0.push_back(numel);
      } else if ((flags & kPaired) && numel != numels0[i]) {
        flags &= ~kPaired;
      }
      key.push_back(numel);
      key.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    }
    out[j] = flags;
    out[kMaxLists + j] = list_ids().id_of(key);
  }
  return true;
}

}  // namespace
}  // namespace mpnb::cpu

// mpnb_list_facts(lists): ``lists`` a sequence of at most kMaxLists sequences of tensors;
// returns the Python list [flags..., ids...]. A TypeError for anything but plain tensors (a
// tensor subclass that dispatches in Python, a tracer), a RuntimeError where a tensor's
// metadata cannot be read (a wrapper without storage): the caller then reads in Python.
extern "C" __attribute__((visibility("default"))) PyObject* mpnb_list_facts(PyObject* lists) {
  using mpnb::cpu::kMaxLists;
  mpnb::cpu::Held outer;
  outer.seq = PySequence_Fast(lists, "mpnb_list_facts: lists must be a sequence of lists");
  if (!outer.seq) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(outer.seq);
  if (n > static_cast<Py_ssize_t>(kMaxLists)) {
    PyErr_SetString(PyExc_ValueError, "mpnb_list_facts: more lists than the pass takes");
    return nullptr;
  }
  int64_t facts[2 * kMaxLists] = {};
  try {
    if (!mpnb::cpu::read_facts(outer.seq, n, facts)) return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(2 * kMaxLists));
  if (!out) return nullptr;
  for (size_t k = 0; k < 2 * kMaxLists; ++k) {
    PyObject* v = PyLong_FromLongLong(facts[k]);
    if (!v) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), v);
  }
  return out;
}

#endif  // __has_include(<Python.h>)
