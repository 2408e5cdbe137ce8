// mpnb_list_facts: what the per-tensor checks and the chunk table of a list op need to know
// about its tensor lists, read in one pass (mpnb/core/ops/triton/_checks.py, list_facts).
//
// A Triton list op checks every tensor (its size against its partner's, its dtype, its layout,
// its device) and keys its chunk table by every tensor's size and address: in Python that is
// one attribute read per tensor per fact, a few hundred nanoseconds each, times thousands of
// tensors on every optimizer step. Here each tensor is read once. Per list the result holds
// flag bits (below) and an id of the list's exact contents (length, device, then each
// tensor's numel and address): equal ids mean equal contents, since an id is never given to
// other contents (ids only grow; when kMaxIds contents are remembered they are all forgotten
// and new ids follow). The table cache keys on these ids, so a tensor moved, resized or replaced by one at
// another address gives a new id and a new table.
//
// Not an op: it reads metadata only, on tensors of any device, and is called by the Triton
// launchers from inside their op's kernel. It is a Python builtin function that the library
// makes (mpnb_list_facts_function, found once through ctypes by
// mpnb/core/ops/triton/_checks.py) taking the Python lists as they are: an op would send every
// tensor through the dispatcher's argument stack a second time, which cost 100 us per AdamW
// step of 76 parameters against 3.5 us for this pass. The names of the failing tensors and
// the messages stay in Python, which runs its own loop on a failed bit. Built only where
// Python's headers are found; without them the launchers read the facts in Python.
#if __has_include(<Python.h>)
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

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
  // FNV-1a over the 64-bit words in four interleaved lanes (one chain of multiplies would
  // wait on each product: a fifth of the pass's time on 152 tensors), folded, then mixed.
  size_t operator()(const std::vector<int64_t>& v) const noexcept {
    constexpr uint64_t kPrime = 1099511628211ull;
    uint64_t h[4] = {1469598103934665603ull, 0x9e3779b97f4a7c15ull, 0xc2b2ae3d27d4eb4full,
                     0x165667b19e3779f9ull};
    const size_t n = v.size();
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (size_t k = 0; k < 4; ++k) h[k] = (h[k] ^ static_cast<uint64_t>(v[i + k])) * kPrime;
    }
    for (; i < n; ++i) h[0] = (h[0] ^ static_cast<uint64_t>(v[i])) * kPrime;
    uint64_t x = h[0];
    for (size_t k = 1; k < 4; ++k) x = (x ^ h[k]) * kPrime;
    x ^= n;
    return static_cast<size_t>(x ^ (x >> 29));
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

// Whether the pass can read `obj` (a tensor of the exact class torch.Tensor or Parameter, not
// one that dispatches in Python); if so, its TensorImpl.
const c10::TensorImpl* plain_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;  // a subclass (a tracer), not a tensor
  const c10::TensorImpl* impl = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  return impl->is_python_dispatch() ? nullptr : impl;
}

// The flags and the id key of each of the `n` lists of `outer` into `flags` and `ids`, each
// tensor read once, straight from its Python object: its facts, its numel and address into
// the list's key (after its length and its first tensor's device). False where the pass
// cannot read a list (anything but plain tensors); a c10::Error (a tensor without storage)
// propagates to the caller. A Python error is set only for a list that is no sequence.
bool read_facts(PyObject* outer, Py_ssize_t n, int64_t* flags_out, int64_t* ids_out) {
  thread_local std::vector<int64_t> key_tls;  // reused: a steady call allocates nothing here
  thread_local std::vector<int64_t> numels_tls;  // list 0's element counts (its partners')
  std::vector<int64_t>& key = key_tls;  // found once (each thread_local use is a TLS lookup)
  std::vector<int64_t>& numels0 = numels_tls;
  std::optional<at::Device> device;
  size_t len0 = 0;
  numels0.clear();
  for (Py_ssize_t j = 0; j < n; ++j) {
    Held held;
    held.seq = PySequence_Fast(PySequence_Fast_GET_ITEM(outer, j), "a list of tensors");
    if (!held.seq) return false;
    const size_t len = static_cast<size_t>(PySequence_Fast_GET_SIZE(held.seq));
    PyObject** items = PySequence_Fast_ITEMS(held.seq);
    if (j == 0) len0 = len;
    int64_t flags = kOneDtype | kContiguous | kSingles | kOneDevice | kBelow2e32;
    if (len == len0) flags |= kPaired;
    key.clear();
    key.push_back(static_cast<int64_t>(len));
    caffe2::TypeMeta dtype;
    for (size_t i = 0; i < len; ++i) {
      const c10::TensorImpl* impl = plain_tensor(items[i]);
      if (impl == nullptr) return false;
      const int64_t numel = impl->numel();
      const caffe2::TypeMeta st = impl->dtype();
      const at::Device dev = impl->device();
      if (i == 0) {
        dtype = st;
        if (!device) device = dev;
        // the device in the key: lists of two devices at equal addresses get two ids
        key.push_back(static_cast<int64_t>(dev.type()) << 16 | (dev.index() & 0xffff));
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
      key.push_back(reinterpret_cast<int64_t>(impl->data()));
    }
    flags_out[j] = flags;
    ids_out[j] = list_ids().id_of(key);
  }
  return true;
}

// (flags, ids) as Python objects: the list of each list's flags, and the dict from each list
// object's id() to its list id (what the chunk table keys by, found by the list object).
PyObject* to_python(PyObject* outer, Py_ssize_t n, const int64_t* flags, const int64_t* ids) {
  PyObject* fl = PyList_New(n);
  PyObject* by_list = PyDict_New();
  if (!fl || !by_list) {
    Py_XDECREF(fl);
    Py_XDECREF(by_list);
    return nullptr;
  }
  for (Py_ssize_t j = 0; j < n; ++j) {
    PyObject* f = PyLong_FromLongLong(flags[j]);
    PyObject* k = PyLong_FromVoidPtr(PySequence_Fast_GET_ITEM(outer, j));
    PyObject* v = PyLong_FromLongLong(ids[j]);
    const bool ok = f && k && v && PyDict_SetItem(by_list, k, v) == 0;
    if (f) PyList_SET_ITEM(fl, j, f);  // the list owns it from here
    Py_XDECREF(k);
    Py_XDECREF(v);
    if (!ok) {
      Py_DECREF(fl);
      Py_DECREF(by_list);
      return nullptr;
    }
  }
  return Py_BuildValue("(NN)", fl, by_list);
}

// list_facts(lists): ``lists`` a sequence of sequences of tensors. Returns (flags, ids) (see
// to_python), or None where the pass cannot read them: a dispatch or torch-function mode is
// on (a tracer may be watching), more than kMaxLists lists, anything but plain tensors, a
// tensor whose metadata cannot be read (a wrapper without storage). The caller then reads
// the flags in Python.
PyObject* list_facts(PyObject* /*self*/, PyObject* lists) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled()) {
    Py_RETURN_NONE;
  }
  Held outer;
  outer.seq = PySequence_Fast(lists, "list_facts: lists must be a sequence of lists");
  if (!outer.seq) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(outer.seq);
  if (n > static_cast<Py_ssize_t>(kMaxLists)) Py_RETURN_NONE;
  int64_t flags[kMaxLists] = {};
  int64_t ids[kMaxLists] = {};
  try {
    if (!read_facts(outer.seq, n, flags, ids)) {
      if (PyErr_Occurred()) return nullptr;
      Py_RETURN_NONE;
    }
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  return to_python(outer.seq, n, flags, ids);
}

PyMethodDef kListFacts = {
    "list_facts",
    list_facts,
    METH_O,
    "list_facts(lists) -> (flags, ids) or None: mpnb's one pass over a list op's tensor lists "
    "(csrc/cpu/list_facts.cpp)."};

}  // namespace
}  // namespace mpnb::cpu

// mpnb_list_facts_function(): the pass as a Python builtin function (a new reference), which
// Python then calls directly: a ctypes call costs about 0.5 us, a builtin's next to nothing.
extern "C" __attribute__((visibility("default"))) PyObject* mpnb_list_facts_function() {
  return PyCFunction_New(&mpnb::cpu::kListFacts, nullptr);
}

#endif  // __has_include(<Python.h>)
