// mpnb's CPU kernels: the one translation unit of the CPU backend.
//
// Every kernel family lives in a header of its own under csrc/cpu/ and registers its ops with
// TORCH_LIBRARY_FRAGMENT(mpnb, ...) / TORCH_LIBRARY_IMPL(mpnb, CPU, ...); including them all
// here pays the (large) cost of compiling the torch headers once. Built just in time by
// mpnb/core/ops/_build.py; called from Python as torch.ops.mpnb.<op>.
#include <torch/library.h>

#include "cpu/amp_c.h"
#include "cpu/opt_adam.h"
#include "cpu/opt_lamb.h"
#include "cpu/opt_sgd.h"
#include "cpu/norm.h"
#include "cpu/softmax.h"
#include "cpu/rope.h"
#include "cpu/dense.h"
#include "cpu/welford.h"

// The namespace is owned here; each family adds its schemas through a fragment.
TORCH_LIBRARY(mpnb, m) {
  m.def("abi_version() -> int", [] { return static_cast<int64_t>(1); });
}
