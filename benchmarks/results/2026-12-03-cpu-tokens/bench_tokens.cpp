#include <train/config.h>
#include <train/data/factory.h>
#include <train/data/token_file.h>
#include <torch/torch.h>
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  const std::string dir = argv[1];
  if (argc > 2) {  // write the corpus once
    std::mt19937 rng(0);
    std::vector<std::vector<int64_t>> docs(20000);
    for (auto& d : docs) { d.resize(20 + rng() % 200); for (auto& t : d) t = 5 + rng() % 29000; }
    train::data::TokenFileOptions o; o.vocab_size = 30522; o.special = {0, 101, 102, 103, 100};
    train::data::write_token_file(dir + "/train.tokens", docs, o);
    train::data::write_token_file(dir + "/val.tokens", docs, o);
    return 0;
  }
  const train::Config c = train::parse_config(
      "model: {name: bert-mlm, preset: bert-tiny}\ndata: {kind: tokens, root: " + dir + ", seq_len: 128, pack: true}\n"
      "trainer: {global_batch: 8, max_steps: 1}\n", "b.yaml");
  auto ds = train::data::make_dataset(c.data, train::data::Split::Train);
  const int64_t n = ds->size();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t sum = 0;
  for (int rep = 0; rep < 3; ++rep)
    for (int64_t i = 0; i < n; ++i) sum += ds->get(i, i).input.size(0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%lld samples in %.3f s: %.1f us/sample (%lld)\n", (long long)(3 * n), s, 1e6 * s / (3 * n), (long long)sum);
}
