// ThreadSanitizer check of the loader (scripts/tsan-loader builds and runs it): three workers
// through full epochs, a restart with a full queue, an abandoned loader, on_error skip and raise,
// and TokenDataset reading one shared token file. Only loader.cpp, tokens.cpp and files.cpp are
// compiled in (with -fsanitize=thread), so Dataset::collate and the log sink are defined here.
// Exits non-zero when a check fails; TSan reports races on stderr and makes the exit code 66.
#include <train/data/loader.h>
#include <train/data/token_file.h>
#include <train/data/tokens.h>
#include <train/errors.h>
#include <train/files.h>
#include <train/log.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <thread>

namespace train::log {
void write(Level, const std::string&) noexcept {}
}  // namespace train::log

namespace train::data {
Batch Dataset::collate(std::vector<Example>&& examples) const {
  std::vector<torch::Tensor> inputs;
  std::vector<torch::Tensor> targets;
  for (Example& example : examples) {
    inputs.push_back(example.input);
    targets.push_back(example.target);
  }
  return Batch{torch::stack(inputs), torch::stack(targets)};
}
}  // namespace train::data

using namespace train::data;

// Fails at every index = 5 mod 13 (8 of 97), after a short index-dependent sleep so that workers
// finish out of order.
class Flaky : public Dataset {
 public:
  int64_t size() const override { return 97; }
  Example get(int64_t index, uint64_t seed) const override {
    std::this_thread::sleep_for(std::chrono::microseconds((index * 7919) % 200));
    if (index % 13 == 5) throw train::DataError("file_" + std::to_string(index) + ".jpg: corrupt");
    return Example{torch::tensor({static_cast<double>(index), static_cast<double>(seed % 1000)}),
                   torch::scalar_tensor(index, torch::kLong)};
  }
  std::vector<int64_t> input_shape() const override { return {2}; }
  int64_t num_classes() const override { return 97; }
  std::string describe() const override { return "flaky"; }
};

int64_t drain(Loader& loader) {
  int64_t n = 0;
  while (auto b = loader.next()) n += b->size();
  return n;
}

int main() {
  at::set_num_threads(1);
  const std::string dir = train::files::make_temp_directory("tsan_tokens_");
  std::vector<std::vector<int64_t>> documents;
  for (int d = 0; d < 200; ++d) {
    std::vector<int64_t> document(static_cast<size_t>(30 + d % 50));
    for (size_t i = 0; i < document.size(); ++i) document[i] = 5 + (d * 31 + static_cast<int64_t>(i) * 7) % 995;
    documents.push_back(document);
  }
  TokenFileOptions file_options;
  file_options.vocab_size = 1000;
  file_options.special = SpecialTokens{0, 1, 2, 3, 4};
  write_token_file(dir + "/c.tokens", documents, file_options);
  TokenDatasetOptions token_options;
  token_options.path = dir + "/c.tokens";
  token_options.seq_len = 64;
  const auto tokens = std::make_shared<TokenDataset>(token_options);
  const auto flaky = std::make_shared<Flaky>();

  int failures = 0;
  auto expect = [&](bool ok, const char* what) {
    if (!ok) {
      std::fprintf(stderr, "FAILED: %s\n", what);
      ++failures;
    }
  };
  for (int round = 0; round < 3; ++round) {
    LoaderOptions options;
    options.batch_size = 4;
    options.workers = 3;
    options.prefetch = 1 + round % 2;
    options.seed = 7;
    options.drop_last = false;
    {
      Loader loader(tokens, options);
      loader.start({0, 0});
      expect(drain(loader) == tokens->size(), "a token epoch delivers every sample");
    }
    {
      Loader loader(tokens, options);
      loader.start({0, 0});
      loader.next();
      loader.start({1, 3});  // restart while the queue is full
      drain(loader);
    }
    {
      // Epoch after epoch: the workers run ahead across each boundary and start() keeps them;
      // a start() a little ahead drops what lies between.
      Loader loader(tokens, options);
      int64_t samples = 0;
      for (int64_t epoch = 0; epoch < 3; ++epoch) {
        loader.start({epoch, 0});
        samples += drain(loader);
      }
      expect(samples == 3 * tokens->size(), "three epochs read back to back deliver every sample thrice");
      loader.start({3, 0});
      loader.next();
      loader.start({3, 2});
      drain(loader);
    }
    {
      // Workers added while batches are in flight.
      Loader loader(tokens, options);
      loader.start({0, 0});
      int64_t samples = 0;
      if (auto batch = loader.next()) samples += batch->size();
      loader.set_workers(options.workers + 2);
      if (auto batch = loader.next()) samples += batch->size();
      loader.set_workers(options.workers + 4);
      samples += drain(loader);
      expect(samples == tokens->size(), "an epoch read while workers are added delivers every sample");
    }
    {
      Loader abandoned(tokens, options);
      abandoned.start({0, 0});
    }
    options.on_error = OnError::Skip;
    {
      Loader loader(flaky, options);
      loader.start({round, 0});
      expect(drain(loader) == 97 && loader.skipped() == 8, "skip replaces the 8 failing samples of 97");
    }
    options.on_error = OnError::Raise;
    {
      Loader loader(flaky, options);
      loader.start({0, 0});
      bool raised = false;
      try {
        drain(loader);
      } catch (const train::DataError&) {
        raised = true;
      }
      expect(raised, "raise raises");
    }
  }
  train::files::remove_all(dir);
  std::puts(failures == 0 ? "loader TSan check: passed" : "loader TSan check: FAILED");
  return failures == 0 ? 0 : 1;
}
