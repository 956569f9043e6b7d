#pragma once
// A dataset whose given samples cannot be loaded (the loader's data.on_error tests).
#include <train/data/dataset.h>
#include <train/errors.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace train::testing {

class BadSamples final : public data::Dataset {
 public:
  BadSamples(data::DatasetPtr base, std::set<int64_t> bad) : base_(std::move(base)), bad_(std::move(bad)) {}
  int64_t size() const override { return base_->size(); }
  data::Example get(int64_t index, uint64_t seed) const override {
    if (bad_.count(index) != 0) throw DataError("sample " + std::to_string(index) + " is damaged");
    return base_->get(index, seed);
  }
  std::vector<int64_t> input_shape() const override { return base_->input_shape(); }
  int64_t num_classes() const override { return base_->num_classes(); }
  std::string describe() const override { return base_->describe() + " (damaged samples)"; }

 private:
  data::DatasetPtr base_;
  std::set<int64_t> bad_;
};

}  // namespace train::testing
