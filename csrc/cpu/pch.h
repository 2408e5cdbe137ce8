// The torch headers every kernel file includes, precompiled once per build (the build passes
// `-include pch/pch.h`; see mpnb/core/ops/_build.py). Every .cpp still includes what it uses,
// so it also compiles without this file. No declarations of ours here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>
