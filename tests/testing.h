#pragma once
// Include this instead of <catch2/catch.hpp> in every test file. c10 defines its own CHECK
// macro (abort on failure, invisible to Catch); LibTorch must come first and lose that macro,
// or Catch's CHECK assertions silently turn into c10's.
#include <torch/torch.h>
#undef CHECK
#include <catch2/catch.hpp>
