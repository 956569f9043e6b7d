#pragma once
// The typed run configuration. YAML in, validated, typed structs out.
//
// Every key is declared once, in the schema in config.cpp, with its type, default, range and
// meaning. Parsing, `--set` overrides, the resolved YAML written into the run directory and the
// generated reference (`train config --reference`) all come from that one table, so the
// documentation cannot drift from the code.
//
// This header is deliberately free of LibTorch and yaml-cpp.
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace train {

// Upper bounds of the config's size and count keys (the schema's ranges, in docs/config.md),
// chosen so that the arithmetic on them (steps x global batch, epochs x steps per epoch, seconds
// in milliseconds) stays far inside int64 and no key can ask for an absurd allocation up front.
namespace limits {
constexpr int64_t kMaxBatch = int64_t{1} << 24;        // samples per optimizer step or micro-batch
constexpr int64_t kMaxSteps = int64_t{1} << 36;        // optimizer steps in one run (~6.9e10)
constexpr int64_t kMaxEpochs = 1000000;
constexpr int64_t kMaxSamples = int64_t{1} << 30;      // synthetic samples per split
constexpr int64_t kMaxImageSize = 16384;               // pixels per side
constexpr int64_t kMaxChannels = 1024;
constexpr int64_t kMaxClasses = int64_t{1} << 24;
constexpr int64_t kMaxWorkers = 1024;                  // loader worker threads
constexpr int64_t kMaxPrefetch = 1024;                 // batches prefetched per worker
constexpr int64_t kMaxThreads = 4096;                  // intra-op CPU threads
constexpr int64_t kMaxSeqLen = int64_t{1} << 20;       // tokens per sample; BERT positions
constexpr int64_t kMaxVocab = int64_t{1} << 24;        // vocabulary size (token ids below it)
constexpr int64_t kMaxHidden = 65536;                  // BERT hidden and head sizes
constexpr int64_t kMaxIntermediate = int64_t{1} << 20; // BERT feed-forward size
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxCudaIndex = 1023;                // cuda:N
constexpr double kMaxWidth = 64;                       // model.width
constexpr double kMaxSeconds = 7 * 24 * 3600;          // timeouts and grace periods: one week
constexpr double kMaxBucketMib = 65536;                // gradient buckets
}  // namespace limits

// model.options: the settings of a program's own model that the other model keys do not hold, a
// YAML map of scalars (`options: {hidden: 256, activation: gelu}`, or `--set model.options.hidden=512`),
// each kept as written. Its builder reads them with the getters, which take a fallback for an
// option that is not given and throw a ConfigError naming 'model.options.NAME' for a value of
// another type. make_model then refuses any option the builder did not ask for (a misspelt name
// would otherwise change nothing), naming those it did. Built-in models read none.
class ModelOptions {
 public:
  ModelOptions() = default;
  explicit ModelOptions(std::map<std::string, std::string> values) : values_(std::move(values)) {}

  bool has(const std::string& name) const;
  int64_t get_int(const std::string& name, int64_t fallback) const;
  double get_float(const std::string& name, double fallback) const;
  bool get_bool(const std::string& name, bool fallback) const;  // true/false, yes/no, on/off
  std::string get_string(const std::string& name, const std::string& fallback) const;

  const std::map<std::string, std::string>& values() const { return values_; }
  bool empty() const { return values_.empty(); }
  // The names a getter or has() asked for, given or not, and the given ones no getter asked for.
  const std::set<std::string>& asked() const { return asked_; }
  std::vector<std::string> unasked() const;

  bool operator==(const ModelOptions& other) const { return values_ == other.values_; }
  bool operator!=(const ModelOptions& other) const { return !(*this == other); }

 private:
  const std::string* find(const std::string& name) const;
  std::map<std::string, std::string> values_;
  mutable std::set<std::string> asked_;
};

struct ModelConfig {
  std::string name;              // registry name, e.g. "resnet18" (required)
  int64_t num_classes = 10;
  int64_t in_channels = 3;
  double width = 1.0;            // channel width multiplier (1.0 = torchvision's widths)
  bool small_input = false;      // 3x3 stride-1 stem without max-pool, for 28x28 / 32x32 images
  std::string init_from;         // optional checkpoint or .safetensors file whose weights initialise the run
  bool init_strict = true;       // init_from must match the model key for key and shape for shape
  // BERT (bert, bert-mlm, bert-classifier): a size preset, then overrides; 0 = the preset's value.
  std::string preset = "bert-base";  // bert-base | bert-small | bert-mini | bert-tiny | minilm-l6
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t layers = 0;
  int64_t heads = 0;
  int64_t intermediate_size = 0;  // 0 = the preset's, or 4 x hidden_size when that is set
  int64_t max_positions = 0;
  int64_t pad_id = -1;           // padding id, masked out of attention; -1 = the data's (else 0)
  double dropout = 0.1;          // hidden and attention-probability dropout
  std::string attention = "auto";  // auto | fused | plain
  bool recompute = false;        // BERT: recompute each encoder layer in backward instead of keeping its activations
  ModelOptions options;          // a program's own model's settings (see ModelOptions)
};

struct DataConfig {
  // idx | synthetic | image_folder | tokens | tsv | custom (the program's own datasets, RunOptions)
  std::string kind = "idx";
  std::string root;              // directory with the dataset files (idx, image_folder)
  std::string train_images = "train-images-idx3-ubyte";   // file stems; ".gz" is tried too
  std::string train_labels = "train-labels-idx1-ubyte";
  std::string val_images = "t10k-images-idx3-ubyte";
  std::string val_labels = "t10k-labels-idx1-ubyte";
  std::string train_dir = "train";  // image_folder: split directories in root, a subdirectory per class
  std::string val_dir = "val";
  int64_t image_size = 0;        // H = W (image_folder: crop size); 0 = own size (synthetic 32, image_folder 224)
  int64_t resize_size = 0;       // image_folder val: shorter side before center crop; 0 = round(image_size / 0.875)
  double crop_min_scale = 0.08;  // image_folder train: smallest area fraction of the random resized crop
  int64_t channels = 1;          // synthetic: channels per image
  int64_t synthetic_train_samples = 1024;
  int64_t synthetic_val_samples = 256;
  std::vector<double> mean;      // per-channel normalisation; empty = no normalisation
  std::vector<double> std;
  bool random_crop = false;      // pad by crop_padding, take a random crop of the original size
  int64_t crop_padding = 2;
  bool random_flip = false;      // horizontal flip with p = 0.5
  bool shuffle = true;
  bool drop_last = true;
  int64_t workers = -1;          // loader worker threads; -1 = let the plan decide
  int64_t prefetch = 2;          // batches prefetched per worker
  std::string on_error = "raise";  // raise | skip: a sample that fails to load stops the run / is replaced
  // image_folder: uint8 batches, normalised on the device (normalize_on_device): on | off | auto
  // (the plan: on when training on a GPU; data::make_dataset alone reads auto as off).
  std::string uint8 = "auto";
  // tokens (train/data/tokens.h): relative paths are taken in root
  std::string train_tokens = "train.tokens";
  std::string val_tokens = "val.tokens";
  std::string vocab_file;        // BERT vocab.txt: vocab size and special ids; "" = from the token file
  int64_t seq_len = 128;         // tokens per sample, [CLS] and [SEP] included
  bool pack = true;              // pack documents into full sequences; false = one (padded) sample per document
  int64_t vocab_size = 0;        // 0 = the vocab file's, else the token file's
  int64_t pad_id = -1;           // special ids; -1 = from vocab_file, else the token file's header
  int64_t unk_id = -1;
  int64_t cls_id = -1;
  int64_t sep_id = -1;
  int64_t mask_id = -1;
  double mask_prob = 0.15;       // MLM: share of non-special tokens selected
  double mask_token_prob = 0.8;  // of the selected: replaced by [MASK]
  double random_token_prob = 0.1;  // of the selected: replaced by a random token
  // tsv (train/text/tsv_dataset.h): text<TAB>label files in root, WordPiece-encoded with
  // vocab_file (required) and seq_len
  std::string train_tsv = "train.tsv";
  std::string val_tsv = "val.tsv";
  bool lowercase = true;         // tsv: uncased vocab (lower-case and strip accents)
};

struct OptimConfig {
  std::string name = "sgd";      // sgd | adamw
  double lr = 0.1;               // learning rate for global_batch (before any plan scaling)
  double momentum = 0.9;
  bool nesterov = false;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  bool decay_norm_and_bias = false;  // apply weight decay to normalisation weights and biases too
  double clip_grad_norm = 0.0;   // 0 = no clipping
  std::string impl = "auto";     // auto | fused | foreach | loop: how a step runs (see make_optimizer)
};

struct ScheduleConfig {
  std::string name = "cosine";   // constant | cosine | step
  int64_t warmup_steps = 0;
  double warmup_epochs = 0.0;    // converted to steps once the epoch length is known; added to warmup_steps
  double min_lr_ratio = 0.0;     // cosine floor as a fraction of the peak lr
  std::vector<double> milestones;  // step: fractions of total steps (0..1) at which lr *= gamma
  double gamma = 0.1;
};

struct LossConfig {
  double label_smoothing = 0.0;
};

struct TrainerConfig {
  int64_t epochs = 0;            // 0 = not set; one of epochs or max_steps is required
  int64_t max_steps = 0;         // optimizer steps; when both are set, training stops at whichever comes first
  int64_t global_batch = 0;      // samples per optimizer step summed over all ranks (required)
  int64_t eval_every_steps = 0;  // 0 = at the end of every epoch (and at the end of training)
  int64_t eval_batch = 0;        // 0 = same as the plan's micro-batch
  int64_t seed = 0;
  std::string device = "auto";   // auto | cpu | cuda | cuda:N
  int64_t threads = 0;           // intra-op CPU threads; 0 = the cores available to the process
  double stop_grace_s = 60;      // after a stop signal: finish the step and checkpoint within this, or exit 128+sig
  std::string on_nonfinite = "stop";  // non-finite loss without loss scaling: stop | rollback
  int64_t max_rollbacks = 3;     // on_nonfinite rollback: give up (stop) after this many in one run
  // Stop after this many evaluations in a row that do not improve checkpoint.best's metric; 0 = off.
  int64_t early_stop_patience = 0;
  double early_stop_min_delta = 0;  // an improvement must beat the best so far by more than this
};

struct TuningConfig {
  std::string device;            // plan for a named device profile (e.g. "a100-80gb") instead of detecting
  std::string batch = "fixed";   // fixed: keep trainer.global_batch everywhere | scale: grow it with memory
  std::string lr_scaling = "linear";  // scale mode: linear | sqrt | none, relative to base_batch
  int64_t base_batch = 0;        // the batch optim.lr was tuned for; 0 = trainer.global_batch
  int64_t max_global_batch = 0;  // scale mode: upper bound; 0 = 32 x base_batch
  int64_t micro_batch = 0;       // per-device micro-batch; 0 = the plan chooses
  int64_t max_micro_batch = 0;   // upper bound for the plan's choice; 0 = none
  bool probe = true;             // measure memory and throughput to choose the micro-batch on a GPU
  double memory_fraction = 0.9;  // share of the device's free memory the plan may use
  bool oom_recovery = true;      // out of memory in a step: halve the micro-batch, double accumulation, redo it
  std::string cuda_graphs = "auto";  // auto | on | off: capture the training step in a CUDA graph and replay it
  std::string cache_dir;         // plan cache; "" = $XDG_CACHE_HOME/train/plans or ~/.cache/train/plans
};

struct PrecisionConfig {
  std::string mode = "auto";          // auto | fp32 | bf16 | fp16
  std::string loss_scaling = "auto";  // auto (dynamic with fp16) | dynamic | off
  std::string channels_last = "auto"; // auto | on | off
};

struct CheckpointConfig {
  int64_t every_steps = 0;       // 0 = only at the end
  double every_minutes = 0;      // also after a step when this long has passed since the last one; 0 = off
  int64_t keep_last = 2;         // periodic checkpoints kept on disk (the final one is always kept)
  std::string best = "none";     // none | accuracy | top5 | loss: keep checkpoints/best.pt by this metric
  std::string async = "auto";    // auto | on | off: write checkpoints on a background thread (the plan decides auto)
};

struct LoggingConfig {
  int64_t every_steps = 50;      // console + metrics.jsonl cadence for training metrics
  std::string level = "info";    // trace | debug | info | warn | error
  bool jsonl = true;             // write metrics.jsonl in the run directory
  bool tensorboard = true;       // write TensorBoard scalar event files in the run directory
};

struct DistributedConfig {
  std::string backend = "auto";  // auto (nccl with GPUs, gloo on CPUs) | nccl | gloo
  double timeout_s = 90;         // a collective (or a dead peer) fails after this long
  double init_timeout_s = 300;   // how long rank 0 waits for the others to join the rendezvous
  double checkpoint_timeout_s = 1800;  // how long the other ranks wait for rank 0 to write a checkpoint
  double bucket_mb = 25;         // gradient bucket size for overlapped allreduce
  double first_bucket_mb = 1;    // the first bucket (last layers) is smaller, so communication starts early
  bool find_unused_parameters = false;  // tolerate parameters that get no gradient (else an error naming them)
  bool broadcast_buffers = true; // copy rank 0's buffers (BatchNorm statistics) to all ranks every step
};

struct Config {
  ModelConfig model;
  DataConfig data;
  OptimConfig optim;
  ScheduleConfig schedule;
  LossConfig loss;
  TrainerConfig trainer;
  TuningConfig tuning;
  PrecisionConfig precision;
  CheckpointConfig checkpoint;
  LoggingConfig logging;
  DistributedConfig distributed;

  std::string source;            // where it was loaded from (file path or "<string>")
  // Where each key given in the file or by --set got its value: key path -> "FILE:LINE:COLUMN" or
  // "--set key=value". Keys left at their defaults are absent.
  std::map<std::string, std::string> origins;
  // The value each key in `origins` had when it was read (as to_yaml writes it), so that where()
  // can tell a value changed in code since from the one at that line.
  std::map<std::string, std::string> origin_values;

  // Where a key was set, for error messages: its origin, else the source. A key whose value was
  // changed in code after it was read is "SOURCE (as changed in code)", not the stale line.
  std::string where(const std::string& key_path) const;
};

// Parses and validates a YAML file, then applies `--set key=value` overrides (each validated
// like a YAML value at that key). Throws ConfigError naming file:line:column and the key path.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});

// Same, from YAML text. `source_name` is used in error messages.
Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides = {});

// Applies parse_config's checks to a Config built or changed in code: every key's type, range and
// allowed values, and the rules between keys. Throws ConfigError naming the key ("<config built in
// code>: key 'optim.lr': must be > 0, got -1"). prepare_run calls it first.
void validate_config(const Config& config);

// Locates an error found after parsing (by the dataset factory, the model registry, the plan):
// a message that starts with "key 'PATH': " or with a key path ("data.image_size is ...") gets
// the place where that key was set in front, "FILE:LINE:COLUMN: "; any other message gets the
// config's source. Used to rethrow such a ConfigError with its location.
std::string locate_config_error(const Config& config, const std::string& message);

// The same for a DataError, whose message is located only when it names a key ("key 'data.root':
// data/x does not exist", from the dataset factory); a message about a file's contents names the
// file and is returned as it is.
std::string locate_data_error(const Config& config, const std::string& message);

// What another value of a key means when a run resumes from a checkpoint written with the old one
// (the reference's "on resume" column; `train fit` warns for the first two).
enum class OnResume {
  Trajectory,  // what is trained changes: the resumed run is no longer the uninterrupted one
  Execution,   // the same training computed differently (kernels, rounding, summation order)
  Free,        // neither: where files are, what is logged or validated, how failures are handled
};

// A key whose value differs between two configs, each value as to_yaml writes it.
struct ConfigChange {
  std::string key;  // "optim.lr"
  std::string before;
  std::string after;
  OnResume on_resume = OnResume::Trajectory;
};
// Every key that differs, in the reference's order.
std::vector<ConfigChange> config_changes(const Config& before, const Config& after);
// Every key's value as to_yaml writes it, in the reference's order.
struct ConfigValue {
  std::string key;
  std::string value;
  OnResume on_resume = OnResume::Trajectory;
};
std::vector<ConfigValue> config_values(const Config& config);

// The fully resolved config (every key, defaults filled in) as YAML that parse_config accepts.
// Its first line starts with kResolvedConfigHeader.
inline constexpr const char* kResolvedConfigHeader = "# train configuration: every key, defaults filled in.";
std::string to_yaml(const Config& config);

// Markdown reference of every key: path, type, default, allowed values, meaning.
std::string config_reference();

}  // namespace train
