// Images per second of an ImageFolder training pipeline (decode, RandomResizedCrop, flip,
// normalise, collate into batches): the C++ side of benchmarks/compare_loader.py, runnable alone.
//
//   bench_loader --folder DIR --batch 64 --workers N --seconds S --json [--impl IMPL] [--size 224] [--uint8 1]
//                [--threads T]
//   bench_loader --data synthetic --batch 256 --workers N --seconds S --json [--size 224] [--threads T]
//
// DIR is the training split (one subdirectory per class). --data synthetic draws train's
// SyntheticImageDataset instead (3 x size x size, 2,048 samples, per-sample ATen ops and the
// default collate, as benchmarks/resnet50_synthetic.yaml), with --impl train only.
// --threads sets the process's intra-op threads (at::set_num_threads) before the loader starts:
// 1 by default, as a PyTorch DataLoader's workers; 0 for every core, which is what train fit's
// plan gives the training thread (and, before 2026-12-06, every loader worker too). IMPL:
//   train       train's Loader: worker threads, batches decoded and resampled straight into one
//               batch tensor (ImageFolderDataset::get_batch), in sampler order.
//   torch-data  LibTorch's torch::data::DataLoader over the same per-sample work
//               (ImageFolderDataset::get, then transforms::Stack), with N workers.
//   decode      the ceiling's numerator: full-size TurboJPEG decodes per second on one thread,
//               of files already in memory (no transform, no loader).
// Batches are drawn epoch after epoch until S seconds have passed; the first --warmup batches
// (default 1: thread start-up, first touches of the file cache) are not counted. Prints one
// JSON object with images_per_s.
#include <train/config.h>
#include <train/data/factory.h>
#include <train/data/image_folder.h>
#include <train/data/loader.h>
#include <train/data/synthetic.h>
#include <train/files.h>

#include <ATen/Parallel.h>
#include <torch/data.h>
#include <turbojpeg.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string folder;
  std::string impl = "train";
  int64_t batch = 64;
  int64_t workers = 2;
  int64_t size = 224;
  int64_t warmup = 1;
  std::string data = "imagefolder";
  int threads = 1;     // intra-op threads; 0 = the cores
  bool uint8 = false;  // uint8 batches, normalised later on the device (data.uint8)
  double seconds = 10.0;
};

[[noreturn]] void usage(const std::string& problem) {
  std::cerr << "bench_loader: " << problem
            << "\nusage: bench_loader --folder DIR [--impl train|torch-data|decode] [--batch 64] "
               "[--workers N] [--seconds S] [--size 224] [--warmup BATCHES] [--uint8 0|1] [--threads T] "
               "[--data imagefolder|synthetic] [--json]\n";
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--json") continue;  // the only output format
    if (i + 1 >= argc) usage(k + " needs a value");
    const std::string v = argv[++i];
    try {
      if (k == "--folder") a.folder = v;
      else if (k == "--impl") a.impl = v;
      else if (k == "--batch") a.batch = std::stoll(v);
      else if (k == "--workers") a.workers = std::stoll(v);
      else if (k == "--seconds") a.seconds = std::stod(v);
      else if (k == "--size") a.size = std::stoll(v);
      else if (k == "--warmup") a.warmup = std::stoll(v);
      else if (k == "--uint8") a.uint8 = std::stoll(v) != 0;
      else if (k == "--threads") a.threads = static_cast<int>(std::stoll(v));
      else if (k == "--data") a.data = v;
      else usage("unknown argument " + k);
    } catch (const std::logic_error&) {
      usage(k + ": not a number: " + v);
    }
  }
  if (a.data != "imagefolder" && a.data != "synthetic") usage("unknown --data " + a.data);
  if (a.data == "imagefolder" && a.folder.empty()) usage("--folder is required");
  if (a.data == "synthetic" && a.impl != "train") usage("--data synthetic goes with --impl train only");
  if (a.threads < 0) usage("--threads must be >= 0");
  if (a.impl != "train" && a.impl != "torch-data" && a.impl != "decode") usage("unknown --impl " + a.impl);
  if (a.batch < 1 || a.workers < 0 || a.seconds <= 0 || a.warmup < 0) usage("values out of range");
  return a;
}

std::shared_ptr<const train::data::ImageFolderDataset> make_folder(const Args& a) {
  train::data::ImageFolderOptions o;
  o.directory = a.folder;
  o.split = train::data::Split::Train;
  o.image_size = a.size;
  o.random_flip = true;
  o.uint8 = a.uint8;
  if (!a.uint8) {
    o.mean = {0.485, 0.456, 0.406};
    o.stddev = {0.229, 0.224, 0.225};
  }
  return std::make_shared<const train::data::ImageFolderDataset>(o);
}

// Counts images after the warm-up batches until the time is up.
struct Meter {
  const Args& args;
  int64_t batches = 0;
  int64_t images = 0;
  Clock::time_point start = Clock::now();
  bool add(int64_t n) {  // false when the time is up
    if (++batches <= args.warmup) {
      start = Clock::now();
      return true;
    }
    images += n;
    return elapsed() < args.seconds;
  }
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - start).count(); }
};

// torch::data's view of the same images: per-sample ImageFolderDataset::get.
class TorchDataFolder : public torch::data::datasets::Dataset<TorchDataFolder> {
 public:
  explicit TorchDataFolder(std::shared_ptr<const train::data::ImageFolderDataset> folder)
      : folder_(std::move(folder)) {}
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    train::data::Example e = folder_->get(i, train::data::sample_seed(1, 0, i));
    return {e.input, e.target};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(folder_->size()); }

 private:
  std::shared_ptr<const train::data::ImageFolderDataset> folder_;
};

std::vector<std::vector<uint8_t>> read_jpegs(const train::data::ImageFolderDataset& folder) {
  std::vector<std::vector<uint8_t>> out;
  for (int64_t i = 0; i < folder.size(); ++i) {
    std::ifstream in(folder.path(i), std::ios::binary);
    out.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  at::set_num_threads(a.threads > 0 ? a.threads
                                     : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  std::shared_ptr<const train::data::ImageFolderDataset> folder;
  std::shared_ptr<const train::data::Dataset> dataset;
  if (a.data == "synthetic") {
    train::data::SyntheticImageOptions o;
    o.samples = 2048;
    o.channels = 3;
    o.image_size = a.size;
    dataset = std::make_shared<const train::data::SyntheticImageDataset>(o);
  } else {
    folder = make_folder(a);
    dataset = folder;
  }
  Meter meter{a};
  int64_t workers = a.workers;

  if (a.impl == "train") {
    train::data::LoaderOptions lo;
    lo.batch_size = a.batch;
    lo.workers = a.workers;
    lo.prefetch = 2;
    lo.seed = 1;
    train::data::Loader loader(dataset, lo);
    bool more = true;
    for (int64_t epoch = 0; more; ++epoch) {
      loader.start({epoch, 0});
      while (more) {
        const std::optional<train::data::Batch> b = loader.next();
        if (!b) break;
        more = meter.add(b->size());
      }
    }
  } else if (a.impl == "torch-data") {
    auto loader = torch::data::make_data_loader(
        TorchDataFolder(folder).map(torch::data::transforms::Stack<>()),
        torch::data::samplers::RandomSampler(static_cast<size_t>(folder->size())),
        torch::data::DataLoaderOptions().batch_size(static_cast<size_t>(a.batch)).workers(
            static_cast<size_t>(a.workers)).drop_last(true));
    bool more = true;
    while (more) {
      for (auto& b : *loader) {
        more = meter.add(b.data.size(0));
        if (!more) break;
      }
    }
  } else {  // decode: one thread, full size, files in memory
    workers = 1;
    const auto jpegs = read_jpegs(*folder);
    tjhandle handle = tjInitDecompress();
    std::vector<uint8_t> pixels;
    bool more = true;
    for (size_t i = 0; more; i = (i + 1) % jpegs.size()) {
      int w = 0, h = 0, sub = 0, cs = 0;
      const auto& f = jpegs[i];
      if (tjDecompressHeader3(handle, f.data(), f.size(), &w, &h, &sub, &cs) != 0) {
        std::cerr << folder->path(static_cast<int64_t>(i)) << ": not a JPEG TurboJPEG can read\n";
        return 1;
      }
      pixels.resize(static_cast<size_t>(w) * h * 3);
      tjDecompress2(handle, f.data(), f.size(), pixels.data(), w, 0, h, TJPF_RGB, 0);
      more = meter.add(1);  // a "batch" of one image
    }
    tjDestroy(handle);
  }
  const double s = meter.elapsed();
  std::cout << "{\"impl\":\"" << a.impl << "\",\"workers\":" << workers << ",\"batch\":" << a.batch
            << ",\"images\":" << meter.images << ",\"seconds\":" << s
            << ",\"images_per_s\":" << meter.images / s << "}" << std::endl;
  return 0;
}
