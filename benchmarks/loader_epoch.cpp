// One pass of train's loader over an ImageFolder (decode with libjpeg-turbo, RandomResizedCrop,
// flip, normalise, collate) — the C++ side of benchmarks/compare_loader.py.
//
//   bench_loader_epoch --root DIR --workers N [--batch 64] [--size 224] [--limit BATCHES]
// Prints one JSON line with images per second.
#include <train/config.h>
#include <train/data/factory.h>
#include <train/data/loader.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  std::string root;
  int64_t workers = 2, batch = 64, size = 224, limit = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--root") root = v;
    else if (k == "--workers") workers = std::stoll(v);
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--size") size = std::stoll(v);
    else if (k == "--limit") limit = std::stoll(v);
    else {
      std::cerr << "unknown argument " << k << "\n";
      return 2;
    }
  }
  at::set_num_threads(1);  // like PyTorch's DataLoader workers: the parallelism is the workers
  train::DataConfig dc;
  dc.kind = "image_folder";
  dc.root = root;
  dc.image_size = size;
  dc.random_flip = true;
  dc.mean = {0.485, 0.456, 0.406};
  dc.std = {0.229, 0.224, 0.225};
  const auto dataset = train::data::make_dataset(dc, train::data::Split::Train);
  train::data::LoaderOptions lo;
  lo.batch_size = batch;
  lo.workers = workers;
  lo.prefetch = 2;
  lo.seed = 1;
  train::data::Loader loader(dataset, lo);
  loader.start({0, 0});
  const auto t0 = std::chrono::steady_clock::now();
  int64_t images = 0, batches = 0;
  while (auto b = loader.next()) {
    images += b->size();
    if (++batches == limit) break;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "{\"impl\":\"cpp\",\"workers\":" << workers << ",\"images\":" << images << ",\"seconds\":" << s
            << ",\"img_per_s\":" << images / s << "}" << std::endl;
  return 0;
}
