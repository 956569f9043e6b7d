#pragma once
// Small networks for 28x28 images (MNIST, Fashion-MNIST). Per-step overhead, not arithmetic,
// bounds their training speed at small batches, which is what the benchmarks in benchmarks/ use
// them for. Registered as `mlp` and `lenet`.
#include "train/models/model.h"

namespace train::models {

// MLP 784-512-512-10: flatten, Linear, ReLU, Linear, ReLU, Linear. The input is
// [B, in_channels, 28, 28]; 669,706 parameters for one channel and 10 classes.
ModelPtr make_mlp(const ModelConfig& config);

// LeNet-style CNN for [B, in_channels, 28, 28]: conv 6 5x5 pad 2, ReLU, max-pool 2, conv 16 5x5,
// ReLU, max-pool 2, then FC 400-120-84-classes with ReLU between. 61,706 parameters for one
// channel and 10 classes.
ModelPtr make_lenet(const ModelConfig& config);

}  // namespace train::models
