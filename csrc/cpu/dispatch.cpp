// How calls reach mpnb's CPU kernels: Autograd-key kernels for the in-place list ops, and the
// extension module's direct Python caller for them.
//
// 1. Autograd-key kernels. An op registered only for the CPU key gets PyTorch's boxed autograd
//    fallback at the Autograd key, which every tensor carries whether or not it requires
//    grad: each call was boxed into IValues, and every C++ copy of a tensor that only Python
//    held moved its refcount from 1 to 2 and back, which increfs/decrefs the Python object
//    under a freshly taken GIL (c10::intrusive_ptr's PyObject preservation). About 1,000
//    instructions per tensor, measured with callgrind: a fused optimizer step over 200
//    parameters passes six lists (1,200 tensors). The kernels below do what that fallback
//    does for these non-differentiable ops (bump the version counter of every tensor the op
//    writes, so autograd still notices the mutation) and redispatch below autograd, unboxed.
//
// 2. The direct Python caller. `torch.ops.mpnb.<op>(...)` still parses every argument through
//    the generic JIT argument parser (about 90 ns per tensor). The caller made here converts
//    plain tensors with the CPython API into *borrowed* at::Tensor handles (no refcount
//    change; a snapshot of each list keeps the Python objects alive for the call) and calls
//    the op with its typed signature *through the dispatcher*: dispatch keys,
//    TorchDispatchModes, fake tensors and the profiler see an ordinary call of `mpnb::<op>`.
//    It steps aside (returns NotImplemented; the Python wrapper then calls torch.ops) whenever
//    torch.ops would do more than convert: a tensor subclass (which may override
//    __torch_function__), an active TorchFunctionMode, keyword arguments, a missing default,
//    or an argument of an unexpected type (torch.ops then raises its own error message).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/python_headers.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// ---- 1. Autograd-key kernels of the in-place list ops -------------------------------------

inline void bump(const at::Tensor& t) {
  if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}
inline void bump(at::TensorList ts) {
  for (const auto& t : ts) bump(t);
}
inline void bump(const std::optional<at::Tensor>& t) {
  if (t.has_value()) bump(*t);
}
template <class X>
inline void bump(const X&) {}  // scalars and bool lists

inline bool needs_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool needs_grad(at::TensorList ts) {
  for (const auto& t : ts)
    if (t.requires_grad()) return true;
  return false;
}
inline bool needs_grad(const std::optional<at::Tensor>& t) { return t.has_value() && needs_grad(*t); }
template <class X>
inline bool needs_grad(const X&) { return false; }

template <class Tag, class Sig>
struct BelowAutograd;

template <class Tag, class Ret, class... Args>
struct BelowAutograd<Tag, Ret(Args...)> {
  static Ret fn(Args... args) {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Tag::name, "").template typed<Ret(Args...)>();
    static const std::vector<bool> writes = [] {
      std::vector<bool> w;
      for (const auto& a : op.schema().arguments())
        w.push_back(a.alias_info() != nullptr && a.alias_info()->isWrite());
      return w;
    }();
    if constexpr (!std::is_void_v<Ret>) {
      // An op with outputs (multi_tensor_l2norm) has no derivative: refuse to drop one silently.
      TORCH_CHECK(!c10::GradMode::is_enabled() || !(needs_grad(args) || ...), Tag::name,
                  " is not differentiable but an input requires grad; call it under "
                  "torch.no_grad() (or detach the inputs).");
    }
    auto bump_written = [&] {
      size_t i = 0;
      ((writes[i++] ? bump(args) : void()), ...);
    };
    if constexpr (std::is_void_v<Ret>) {
      {
        at::AutoDispatchBelowADInplaceOrView below;
        op.call(args...);
      }
      bump_written();
    } else {
      Ret out;
      {
        at::AutoDispatchBelowADInplaceOrView below;
        out = op.call(args...);
      }
      bump_written();
      return out;
    }
  }
};

using TL = at::TensorList;
using T = const at::Tensor&;
using OptT = const std::optional<at::Tensor>&;

// Every op with tensor lists, with the C++ signature of its schema (csrc/cpu/*.h).
#define MPNB_LIST_OPS(X)                                                                       \
  X(multi_tensor_scale, void(T, TL, TL, double, OptT))                                         \
  X(multi_tensor_axpby, void(T, TL, TL, TL, double, double, int64_t))                          \
  X(multi_tensor_l2norm, std::tuple<at::Tensor, at::Tensor>(T, TL, bool, OptT))                \
  X(multi_tensor_check_finite, void(T, TL))                                                    \
  X(update_scale_hysteresis, void(T, T, T, T, double, double, int64_t, int64_t))               \
  X(update_loss_scale_, void(T, T, T, T, T, double, double, int64_t, int64_t, double, double))  \
  X(fused_adam_, void(TL, TL, TL, TL, TL, TL, double, double, double, double, double, bool,   \
                      bool, OptT, OptT))                                                       \
  X(fused_adagrad_, void(TL, TL, TL, TL, TL, double, double, double, double, bool, OptT,      \
                         OptT))                                                                \
  X(fused_sgd_, void(TL, TL, TL, TL, c10::List<bool>, double, double, double, double, bool,   \
                     bool, OptT, OptT))                                                        \
  X(fused_lamb_, void(TL, TL, TL, TL, TL, TL, T, double, double, double, double, double, bool, \
                      bool, bool, double, bool, OptT, OptT))                                   \
  X(fused_novograd_, void(TL, TL, TL, TL, TL, TL, T, double, double, double, double, double,   \
                          bool, bool, bool, int64_t, bool, OptT, OptT))

#define MPNB_TAG(NAME, ...) \
  struct tag_##NAME {       \
    static constexpr const char* name = "mpnb::" #NAME; \
  };
MPNB_LIST_OPS(MPNB_TAG)
#undef MPNB_TAG

}  // namespace

TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
#define MPNB_AUTOGRAD(NAME, ...) m.impl(#NAME, &BelowAutograd<tag_##NAME, __VA_ARGS__>::fn);
  MPNB_LIST_OPS(MPNB_AUTOGRAD)
#undef MPNB_AUTOGRAD
}

namespace {

// ---- 2. The direct Python caller -----------------------------------------------------------

// Why a conversion stepped aside: not an error, torch.ops takes the call instead.
struct StepAside {};

inline int64_t as_int(PyObject* obj) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) throw StepAside{};
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {  // out of int64 range: torch.ops gives the error
    PyErr_Clear();
    throw StepAside{};
  }
  return static_cast<int64_t>(v);
}

// A tensor handle at +0 refcount. Valid while the Python object it came from lives.
inline at::Tensor borrow(PyObject* obj) {
  // Exact torch.Tensor or nn.Parameter only: subclasses may override __torch_function__.
  if (!THPVariable_CheckExact(obj)) throw StepAside{};
  return at::Tensor(c10::intrusive_ptr<at::TensorImpl, at::UndefinedTensorImpl>::reclaim(
      THPVariable_Unpack(obj).unsafeGetTensorImpl()));
}

inline void unborrow(at::Tensor& t) { t.unsafeReleaseTensorImpl(); }

// An owned Python reference (moves only).
struct PyRef {
  PyObject* obj = nullptr;
  PyRef() = default;
  explicit PyRef(PyObject* o) : obj(o) {}
  PyRef(PyRef&& o) noexcept : obj(std::exchange(o.obj, nullptr)) {}
  PyRef& operator=(PyRef&&) = delete;
  ~PyRef() { Py_XDECREF(obj); }
};

// Borrowed tensors, released (never decref'd) when the vector goes away.
struct BorrowedVec {
  std::vector<at::Tensor> v;
  BorrowedVec() = default;
  BorrowedVec(BorrowedVec&&) noexcept = default;
  ~BorrowedVec() {
    for (auto& t : v) unborrow(t);
  }
};

// From<T>: holds the C++ value of one argument of C++ type T, converted from Python.
template <class T>
struct From;

template <>
struct From<double> {
  double value;
  explicit From(PyObject* o)
      : value(PyFloat_Check(o) ? PyFloat_AS_DOUBLE(o) : static_cast<double>(as_int(o))) {}
  double get() const { return value; }
};

template <>
struct From<int64_t> {
  int64_t value;
  explicit From(PyObject* o) : value(as_int(o)) {}
  int64_t get() const { return value; }
};

template <>
struct From<bool> {
  bool value;
  explicit From(PyObject* o) : value(o == Py_True) {
    if (!PyBool_Check(o)) throw StepAside{};
  }
  bool get() const { return value; }
};

template <>
struct From<const at::Tensor&> {
  BorrowedVec held;
  explicit From(PyObject* o) { held.v.push_back(borrow(o)); }
  const at::Tensor& get() const { return held.v[0]; }
};

template <>
struct From<const std::optional<at::Tensor>&> {
  BorrowedVec held;
  std::optional<at::Tensor> value;
  explicit From(PyObject* o) {
    if (o != Py_None) held.v.push_back(borrow(o));
  }
  From(From&& other) noexcept : held(std::move(other.held)) {}
  ~From() {
    if (value.has_value()) unborrow(*value);
  }
  const std::optional<at::Tensor>& get() {
    // Built on demand from the borrowed handle, so the optional never owns a reference.
    if (!held.v.empty() && !value.has_value())
      value.emplace(at::Tensor(c10::intrusive_ptr<at::TensorImpl, at::UndefinedTensorImpl>::reclaim(
          held.v[0].unsafeGetTensorImpl())));
    return value;
  }
};

template <>
struct From<at::TensorList> {
  PyRef snapshot;  // a tuple of the list's items: keeps them alive while the GIL is released
  BorrowedVec held;
  static PyObject* tuple_of(PyObject* o) {
    if (!PyList_Check(o) && !PyTuple_Check(o)) throw StepAside{};
    PyObject* t = PySequence_Tuple(o);  // a tuple is returned as is, with a new reference
    if (t == nullptr) {
      PyErr_Clear();
      throw StepAside{};
    }
    return t;
  }
  explicit From(PyObject* o) : snapshot(tuple_of(o)) {
    const Py_ssize_t n = PyTuple_GET_SIZE(snapshot.obj);
    held.v.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) held.v.push_back(borrow(PyTuple_GET_ITEM(snapshot.obj, i)));
  }
  at::TensorList get() const { return held.v; }
};

template <>
struct From<c10::List<bool>> {
  c10::List<bool> value;
  explicit From(PyObject* o) {
    if (!PyList_Check(o) && !PyTuple_Check(o)) throw StepAside{};
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    value.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyBool_Check(items[i])) throw StepAside{};
      value.push_back(items[i] == Py_True);
    }
  }
  c10::List<bool> get() const { return value; }
};

// Release the GIL for the duration of the call. No refcount of a Python-held tensor moves in
// the direct path; kernels that call back into Python (a TorchDispatchMode, a Python autograd
// formula) take the GIL again themselves.
struct NoGil {
  PyThreadState* state = PyEval_SaveThread();
  NoGil() = default;
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() { PyEval_RestoreThread(state); }
};

inline PyObject* to_python(at::Tensor&& t) { return THPVariable_Wrap(std::move(t)); }

inline PyObject* to_python(std::tuple<at::Tensor, at::Tensor>&& r) {
  PyObject* a = THPVariable_Wrap(std::move(std::get<0>(r)));
  if (a == nullptr) return nullptr;
  PyObject* b = THPVariable_Wrap(std::move(std::get<1>(r)));
  if (b == nullptr) {
    Py_DECREF(a);
    return nullptr;
  }
  PyObject* t = PyTuple_New(2);
  if (t == nullptr) {
    Py_DECREF(a);
    Py_DECREF(b);
    return nullptr;
  }
  PyTuple_SET_ITEM(t, 0, a);
  PyTuple_SET_ITEM(t, 1, b);
  return t;
}

template <class Sig>
struct Invoke;

template <class Ret, class... Args>
struct Invoke<Ret(Args...)> {
  static constexpr Py_ssize_t arity = sizeof...(Args);

  template <size_t... I>
  static PyObject* run(const c10::TypedOperatorHandle<Ret(Args...)>& op, PyObject* const* args,
                       std::index_sequence<I...>) {
    std::tuple<From<Args>...> conv{From<Args>(args[I])...};
    if constexpr (std::is_void_v<Ret>) {
      {
        NoGil no_gil;
        op.call(std::get<I>(conv).get()...);
      }
      Py_RETURN_NONE;
    } else {
      Ret out;
      {
        NoGil no_gil;
        out = op.call(std::get<I>(conv).get()...);
      }
      return to_python(std::move(out));
    }
  }
};

using Entry = PyObject* (*)(PyObject* const* args, Py_ssize_t nargs);

template <class Sig>
PyObject* call_typed(const char* qualified, PyObject* const* args, Py_ssize_t nargs) {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow(qualified, "").template typed<Sig>();
  if (nargs != Invoke<Sig>::arity) Py_RETURN_NOTIMPLEMENTED;  // defaults: torch.ops fills them
  try {
    return Invoke<Sig>::run(op, args, std::make_index_sequence<Invoke<Sig>::arity>{});
  } catch (const StepAside&) {
    Py_RETURN_NOTIMPLEMENTED;
  }
}

#define MPNB_ENTRY(NAME, ...)                                              \
  {#NAME, [](PyObject* const* a, Py_ssize_t n) -> PyObject* {              \
     return call_typed<__VA_ARGS__>("mpnb::" #NAME, a, n);                 \
   }},

const std::pair<const char*, Entry> kEntries[] = {MPNB_LIST_OPS(MPNB_ENTRY)};
#undef MPNB_ENTRY

PyObject* call_op(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  if ((kwnames != nullptr && PyTuple_GET_SIZE(kwnames) > 0) || at::impl::torch_function_mode_enabled())
    Py_RETURN_NOTIMPLEMENTED;
  return kEntries[PyLong_AsSize_t(self)].second(args, nargs);
  END_HANDLE_TH_ERRORS
}

PyMethodDef call_def = {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(call_op)),
                        METH_FASTCALL | METH_KEYWORDS,
                        "Call this mpnb op through the dispatcher, or return NotImplemented."};

// caller(name) -> a builtin that calls mpnb::<name>, or None for an op without one.
PyObject* make_caller(PyObject* /*module*/, PyObject* name) {
  if (!PyUnicode_Check(name)) {
    PyErr_SetString(PyExc_TypeError,
                    "caller(name): name must be a str such as 'multi_tensor_scale'.");
    return nullptr;
  }
  const char* text = PyUnicode_AsUTF8(name);
  if (text == nullptr) return nullptr;
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i) {
    if (std::string(kEntries[i].first) != text) continue;
    PyObject* id = PyLong_FromSize_t(i);
    if (id == nullptr) return nullptr;
    PyObject* fn = PyCFunction_NewEx(&call_def, id, nullptr);
    Py_DECREF(id);
    return fn;
  }
  Py_RETURN_NONE;
}

// grads(params, drop_none) -> [p.grad for p in params] (without the Nones when drop_none).
// The attribute read costs ~80 ns per nn.Parameter from Python; amp reads every grad twice a
// step. Tensor subclasses (whose .grad may be a property) are read through getattr.
PyObject* grads_of(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 2 || (!PyList_Check(args[0]) && !PyTuple_Check(args[0])) || !PyBool_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "grads(params, drop_none): pass a list of tensors and a bool.");
    return nullptr;
  }
  const bool drop_none = args[1] == Py_True;
  PyRef seq(PySequence_Tuple(args[0]));
  if (seq.obj == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(seq.obj);
  PyRef out(PyList_New(0));
  if (out.obj == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyTuple_GET_ITEM(seq.obj, i);
    PyObject* g;
    if (THPVariable_CheckExact(p)) {
      const at::Tensor& grad = THPVariable_Unpack(p).grad();
      if (!grad.defined()) {
        if (drop_none) continue;
        Py_INCREF(Py_None);
        g = Py_None;
      } else {
        g = THPVariable_Wrap(grad);
      }
    } else {
      g = PyObject_GetAttrString(p, "grad");
      if (g != nullptr && g == Py_None && drop_none) {
        Py_DECREF(g);
        continue;
      }
    }
    if (g == nullptr) return nullptr;
    const int rc = PyList_Append(out.obj, g);
    Py_DECREF(g);
    if (rc != 0) return nullptr;
  }
  return std::exchange(out.obj, nullptr);
  END_HANDLE_TH_ERRORS
}

// ---- 3. amp's per-step grad work, without a Python object per grad -----------------------
// Reading `.grad` makes (or finds) a Python object for every grad: ~80 ns per param, twice a
// step. amp only needs to know whether any grad is set before a backward, and to unscale the
// grads after it; both are done here on the params' C++ grads.

// The Python object of a tensor if it has one (nullptr otherwise); `unknown` on a PyTorch
// without PyObjectSlot::load_pyobj (the callers then take their Python path).
PyObject* const kUnknownPyObj = reinterpret_cast<PyObject*>(1);
template <class Slot>
auto slot_pyobj(const Slot* s, int) -> decltype(s->load_pyobj()) {
  return s->load_pyobj();
}
template <class Slot>
PyObject* slot_pyobj(const Slot*, long) {
  return kUnknownPyObj;
}

// A grad that Python code may treat specially: a tensor subclass (its Python object is not an
// exact torch.Tensor/Parameter) or a tensor with the Python dispatch key.
inline bool plain_grad(const at::Tensor& g) {
  if (g.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::Python)) return false;
  PyObject* obj = slot_pyobj(g.unsafeGetTensorImpl()->pyobj_slot(), 0);
  return obj == nullptr || (obj != kUnknownPyObj && THPVariable_CheckExact(obj));
}

// any_grad(params) -> True when some param has a .grad.
PyObject* any_grad(PyObject* /*module*/, PyObject* params) {
  HANDLE_TH_ERRORS
  if (!PyList_Check(params) && !PyTuple_Check(params)) {
    PyErr_SetString(PyExc_TypeError, "any_grad(params): pass a list of tensors.");
    return nullptr;
  }
  // Re-read the size and the item each time: a subclass's .grad property is Python code.
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(params); ++i) {
    PyObject* p = PySequence_Fast_GET_ITEM(params, i);
    if (THPVariable_CheckExact(p)) {
      if (THPVariable_Unpack(p).grad().defined()) Py_RETURN_TRUE;
      continue;
    }
    Py_INCREF(p);
    PyRef keep(p);
    PyRef g(PyObject_GetAttrString(p, "grad"));  // a subclass: its .grad may be a property
    if (g.obj == nullptr) return nullptr;
    if (g.obj != Py_None) Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
  END_HANDLE_TH_ERRORS
}

// unscale_grads(params, found_inf, inv_scale, update=None) -> bool
// The set grads of `params` (unused params are skipped) times inv_scale, in place, with
// found_inf raised on inf/NaN: one call of mpnb::multi_tensor_scale through the dispatcher.
// With `update` = (scale, growth_tracker, hysteresis_tracker, growth_factor, backoff_factor,
// growth_interval, hysteresis, min_scale, max_scale), mpnb::update_loss_scale_ follows (the
// dynamic scale update of the step), so a scale_loss exit is one call from Python.
// Returns False without doing anything when the Python path must decide instead: a param or
// grad that is a tensor subclass or carries the Python key, grads of several dtypes, a
// non-CPU or non-contiguous grad, an active TorchFunctionMode, an argument of another type.
PyObject* unscale_grads(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  static const auto scale_op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("mpnb::multi_tensor_scale", "")
                                   .typed<void(T, TL, TL, double, OptT)>();
  static const auto update_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mpnb::update_loss_scale_", "")
          .typed<void(T, T, T, T, T, double, double, int64_t, int64_t, double, double)>();
  if ((nargs != 3 && nargs != 4) || (!PyList_Check(args[0]) && !PyTuple_Check(args[0]))) {
    PyErr_SetString(PyExc_TypeError,
                    "unscale_grads(params, found_inf, inv_scale, update=None): pass a list of "
                    "tensors, two one-element tensors and None or the update's 9 arguments.");
    return nullptr;
  }
  PyObject* update = nargs == 4 ? args[3] : Py_None;
  if (at::impl::torch_function_mode_enabled() || !THPVariable_CheckExact(args[1]) ||
      !THPVariable_CheckExact(args[2]) || !THPVariable_Unpack(args[1]).device().is_cpu())
    Py_RETURN_FALSE;
  if (update != Py_None && (!PyTuple_Check(update) || PyTuple_GET_SIZE(update) != 9))
    Py_RETURN_FALSE;
  // Convert every argument before any work: a StepAside leaves everything untouched.
  std::optional<std::tuple<From<const at::Tensor&>, From<const at::Tensor&>, From<const at::Tensor&>,
                           From<double>, From<double>, From<int64_t>, From<int64_t>, From<double>,
                           From<double>>>
      upd;
  try {
    if (update != Py_None) {
      PyObject* const* u = &PyTuple_GET_ITEM(update, 0);
      upd.emplace(From<const at::Tensor&>(u[0]), From<const at::Tensor&>(u[1]),
                  From<const at::Tensor&>(u[2]), From<double>(u[3]), From<double>(u[4]),
                  From<int64_t>(u[5]), From<int64_t>(u[6]), From<double>(u[7]), From<double>(u[8]));
    }
  } catch (const StepAside&) {
    Py_RETURN_FALSE;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
  PyObject** items = PySequence_Fast_ITEMS(args[0]);
  // The GIL stays held while the handles are borrowed (nothing can reset a .grad meanwhile);
  // a call with enough work to matter takes owning handles and releases it.
  BorrowedVec borrowed;  // released, never decref'd, when it goes away (also on return False)
  auto& grads = borrowed.v;
  grads.reserve(static_cast<size_t>(n));
  int64_t numel = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_CheckExact(items[i])) Py_RETURN_FALSE;
    const at::Tensor& g = THPVariable_Unpack(items[i]).grad();
    if (!g.defined()) continue;
    if (!g.device().is_cpu() || !plain_grad(g) || !g.is_contiguous()) Py_RETURN_FALSE;
    if (!grads.empty() && g.scalar_type() != grads[0].scalar_type()) Py_RETURN_FALSE;
    numel += g.numel();
    grads.push_back(at::Tensor(c10::intrusive_ptr<at::TensorImpl, at::UndefinedTensorImpl>::reclaim(
        g.unsafeGetTensorImpl())));
  }
  From<const at::Tensor&> flag(args[1]);
  From<const std::optional<at::Tensor>&> inv(args[2]);
  if (grads.empty()) {
  } else if (numel < (int64_t{1} << 17)) {
    scale_op.call(flag.get(), borrowed.v, borrowed.v, 1.0, inv.get());
  } else {
    std::vector<at::Tensor> owned(borrowed.v.begin(), borrowed.v.end());
    NoGil no_gil;
    scale_op.call(flag.get(), owned, owned, 1.0, inv.get());
  }
  if (upd.has_value()) {
    auto& u = *upd;
    update_op.call(std::get<0>(u).get(), *inv.get(), std::get<1>(u).get(), std::get<2>(u).get(),
                   flag.get(), std::get<3>(u).get(), std::get<4>(u).get(), std::get<5>(u).get(),
                   std::get<6>(u).get(), std::get<7>(u).get(), std::get<8>(u).get());
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

PyMethodDef module_methods[] = {
    {"caller", make_caller, METH_O,
     "caller(name): a direct positional caller of torch.ops.mpnb.<name>, or None."},
    {"grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(grads_of)), METH_FASTCALL,
     "grads(params, drop_none): [p.grad for p in params], read in C++."},
    {"any_grad", any_grad, METH_O, "any_grad(params): True when some param has a .grad."},
    {"unscale_grads", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(unscale_grads)),
     METH_FASTCALL,
     "unscale_grads(params, found_inf, inv_scale, update=None): unscale the params' grads in "
     "place in one multi_tensor_scale call, then the loss-scale update if given; False when "
     "the Python path must do it."},
    {nullptr, nullptr, 0, nullptr}};

#define MPNB_STR_(x) #x
#define MPNB_STR(x) MPNB_STR_(x)
#define MPNB_CAT_(a, b) a##b
#define MPNB_CAT(a, b) MPNB_CAT_(a, b)

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, MPNB_STR(TORCH_EXTENSION_NAME),
                          "mpnb's CPU kernels (ops registered in torch.ops.mpnb) and their "
                          "direct Python caller.",
                          -1, module_methods};

}  // namespace

PyMODINIT_FUNC MPNB_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
