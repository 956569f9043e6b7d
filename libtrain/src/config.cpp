// The configuration schema and everything derived from it: YAML parsing and validation,
// `--set key=value` overrides, the resolved YAML written into the run directory and the
// Markdown reference.
//
// `schema()` is the single source of truth: one `Key` per config field with its type, range,
// meaning and accessors into `Config`. Defaults are not repeated here; they are read from a
// default-constructed `Config` through each key's getter.
#include "train/config.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <type_traits>
#include <utility>
#include <variant>

#include "models/bert_presets.h"
#include "optimizer_names.h"
#include "suggest.h"
#include "train/errors.h"
#include "train/files.h"
#include "train/log.h"

namespace train {
namespace {

// ---- Schema -----------------------------------------------------------------------------------

// The value of one key; the alternative matches the key's field type in `Config`.
using OptionMap = std::map<std::string, std::string>;
using Value = std::variant<int64_t, double, bool, std::string, std::vector<double>, OptionMap>;

enum class Type { Int, Float, Bool, String, Enum, FloatList, Map };

struct Bound {
  double value;
  bool inclusive;
};

// An extra rule for a string key: returns the problem, or "" when the value is fine.
using StringCheck = std::function<std::string(const std::string&)>;

struct Key {
  std::string section;
  std::string name;
  std::string path;  // "section.name"
  Type type = Type::String;
  std::string meaning;
  std::optional<Bound> lower;  // for Type::FloatList the bounds apply to every element
  std::optional<Bound> upper;
  std::vector<std::string> allowed;  // Type::Enum only
  bool required = false;
  StringCheck check;          // Type::String only
  std::string check_summary;  // what `check` accepts, for the reference
  OnResume on_resume = OnResume::Trajectory;  // what another value in a resumed run means
  std::function<Value(const Config&)> get;
  std::function<void(Config&, const Value&)> set;

  // Builders used by the schema table.
  Key& at_least(double v) {
    lower = Bound{v, true};
    return *this;
  }
  Key& above(double v) {
    lower = Bound{v, false};
    return *this;
  }
  Key& at_most(double v) {
    upper = Bound{v, true};
    return *this;
  }
  Key& below(double v) {
    upper = Bound{v, false};
    return *this;
  }
  Key& one_of(std::vector<std::string> values) {
    type = Type::Enum;
    allowed = std::move(values);
    return *this;
  }
  Key& is_required() {
    required = true;
    return *this;
  }
  Key& checked_by(StringCheck rule, std::string summary) {
    check = std::move(rule);
    check_summary = std::move(summary);
    return *this;
  }
  // Another value in a resumed run changes how the same training is computed, not what it is.
  Key& execution_only() {
    on_resume = OnResume::Execution;
    return *this;
  }
  // Another value in a resumed run changes neither the training nor its arithmetic.
  Key& free_on_resume() {
    on_resume = OnResume::Free;
    return *this;
  }
};

template <typename Field>
Type type_of() {
  if constexpr (std::is_same_v<Field, int64_t>) {
    return Type::Int;
  } else if constexpr (std::is_same_v<Field, double>) {
    return Type::Float;
  } else if constexpr (std::is_same_v<Field, bool>) {
    return Type::Bool;
  } else if constexpr (std::is_same_v<Field, std::string>) {
    return Type::String;
  } else if constexpr (std::is_same_v<Field, ModelOptions>) {
    return Type::Map;
  } else {
    static_assert(std::is_same_v<Field, std::vector<double>>, "unsupported config field type");
    return Type::FloatList;
  }
}

// Makes the keys of one section: `optim("lr", &OptimConfig::lr, "meaning")`.
template <typename Section>
class SectionKeys {
 public:
  // `on_resume`: the section's default class for its keys (a key's builder may change it).
  SectionKeys(const char* name, Section Config::*member, OnResume on_resume = OnResume::Trajectory)
      : name_(name), member_(member), on_resume_(on_resume) {}

  template <typename Field>
  Key operator()(const char* key_name, Field Section::*field, const char* meaning) const {
    Key key;
    key.section = name_;
    key.name = key_name;
    key.path = std::string(name_) + "." + key_name;
    key.type = type_of<Field>();
    key.meaning = meaning;
    key.on_resume = on_resume_;
    const auto member = member_;
    if constexpr (std::is_same_v<Field, ModelOptions>) {
      key.get = [member, field](const Config& c) -> Value { return ((c.*member).*field).values(); };
      key.set = [member, field](Config& c, const Value& v) { (c.*member).*field = ModelOptions(std::get<OptionMap>(v)); };
    } else {
      key.get = [member, field](const Config& c) -> Value { return (c.*member).*field; };
      key.set = [member, field](Config& c, const Value& v) {
        (c.*member).*field = std::get<Field>(v);
      };
    }
    return key;
  }

 private:
  const char* name_;
  Section Config::*member_;
  OnResume on_resume_;
};

struct SectionInfo {
  const char* name;
  const char* meaning;
};

// In the order of to_yaml and the reference.
constexpr SectionInfo kSections[] = {
    {"model", "The network to build."},
    {"data", "Dataset, preprocessing and the input pipeline."},
    {"optim", "Optimizer."},
    {"schedule", "Learning-rate schedule."},
    {"loss", "Training loss."},
    {"trainer", "Length of training, batch size, evaluation, seed and device."},
    {"tuning", "Limits for the execution plan."},
    {"precision", "Numeric precision and memory layout; auto lets the plan choose per device."},
    {"checkpoint", "Periodic checkpoints."},
    {"logging", "Console and metrics output."},
    {"distributed", "Data-parallel training over c10d (used when launched with more than one rank)."},
};

struct OptimizerNames {
  std::mutex mutex;
  std::vector<std::string> names{"sgd", "adamw"};
};

OptimizerNames& optimizer_names_accepted() {
  static OptimizerNames* names = new OptimizerNames();  // never destroyed: usable at exit
  return *names;
}

std::string check_optimizer_name(const std::string& name);  // (below: it words like the enums)

std::string check_device(const std::string& device) {
  if (device == "auto" || device == "cpu" || device == "cuda") return "";
  const std::string prefix = "cuda:";
  const std::string index = device.substr(std::min(device.size(), prefix.size()));
  if (device.compare(0, prefix.size(), prefix) == 0 && !index.empty() &&
      std::all_of(index.begin(), index.end(), [](unsigned char c) { return std::isdigit(c); })) {
    const size_t first = std::min(index.find_first_not_of('0'), index.size() - 1);
    if (index.size() - first > 4 || std::stoll(index.substr(first)) > limits::kMaxCudaIndex)
      return "device index " + index + " is out of range; cuda:N takes N in [0, " +
             std::to_string(limits::kMaxCudaIndex) + "]";
    return "";
  }
  return "must be auto, cpu, cuda or cuda:N (N a device index), got '" + device + "'";
}

std::vector<Key> build_schema() {
  const SectionKeys model("model", &Config::model);
  const SectionKeys data("data", &Config::data);
  const SectionKeys optim("optim", &Config::optim);
  const SectionKeys schedule("schedule", &Config::schedule);
  const SectionKeys loss("loss", &Config::loss);
  const SectionKeys trainer("trainer", &Config::trainer);
  // The plan's numbers that tuning decides (batch, LR, micro-batch, precision) are compared as
  // saved in the checkpoint, since the machine decides them as well.
  const SectionKeys tuning("tuning", &Config::tuning, OnResume::Free);
  const SectionKeys precision("precision", &Config::precision);
  const SectionKeys checkpoint("checkpoint", &Config::checkpoint, OnResume::Free);
  const SectionKeys logging("logging", &Config::logging, OnResume::Free);
  const SectionKeys distributed("distributed", &Config::distributed);
  using M = ModelConfig;
  using D = DataConfig;
  using O = OptimConfig;
  using S = ScheduleConfig;
  using T = TrainerConfig;
  return {
      model("name", &M::name, "registry name of the network, e.g. resnet18").is_required(),
      model("num_classes", &M::num_classes,
            "number of output classes, at least the data's classes (bert-mlm: its output is model.vocab_size "
            "wide, and this is only checked: at least the token data's vocabulary)")
          .at_least(1)
          .at_most(limits::kMaxClasses),
      model("in_channels", &M::in_channels, "channels of the input images").at_least(1).at_most(limits::kMaxChannels),
      model("width", &M::width, "channel width multiplier (1.0 = torchvision's widths)").above(0).at_most(limits::kMaxWidth),
      model("small_input", &M::small_input,
            "3x3 stride-1 stem without max-pool, for 28x28 / 32x32 images"),
      model("init_from", &M::init_from,
            "weights that initialise the run: a train checkpoint (.pt) or a .safetensors file with "
            "state-dict names (torchvision's for ResNet); empty = random initialisation").free_on_resume(),
      model("init_strict", &M::init_strict,
            "init_from must match the model key for key and shape for shape, except the task head (fc, "
            "BERT's pooler, classifier or MLM head), which starts fresh where the file lacks it or has "
            "other shapes, and tensors of heads the model lacks or tied copies, which are skipped; all "
            "of these are logged. false = also load a partial match and list the rest in a warning").free_on_resume(),
      model("preset", &M::preset,
            "BERT sizes: bert-base (L12 H768 A12), bert-small (L4 H512 A8), bert-mini (L4 H256 A4), "
            "bert-tiny (L2 H128 A2), minilm-l6 (L6 H384 A12); vocab 30522, 512 positions")
          .one_of({"bert-base", "bert-small", "bert-mini", "bert-tiny", "minilm-l6"}),
      model("vocab_size", &M::vocab_size,
            "BERT: vocabulary size (at least the data's: the vocab file's or the token file's); 0 = the preset's")
          .at_least(0)
          .at_most(limits::kMaxVocab),
      model("hidden_size", &M::hidden_size, "BERT: hidden size (a multiple of heads); 0 = the preset's")
          .at_least(0)
          .at_most(limits::kMaxHidden),
      model("layers", &M::layers, "BERT: encoder layers; 0 = the preset's").at_least(0).at_most(limits::kMaxLayers),
      model("heads", &M::heads, "BERT: attention heads (divides hidden_size); 0 = the preset's")
          .at_least(0)
          .at_most(limits::kMaxHidden),
      model("intermediate_size", &M::intermediate_size,
            "BERT: feed-forward size; 0 = the preset's (4 x hidden_size when hidden_size is set)")
          .at_least(0)
          .at_most(limits::kMaxIntermediate),
      model("max_positions", &M::max_positions,
            "BERT: position embeddings (longest sequence; at least data.seq_len); 0 = the preset's")
          .at_least(0)
          .at_most(limits::kMaxSeqLen),
      model("pad_id", &M::pad_id,
            "BERT: the padding id, masked out of attention (input != pad_id); -1 = the data's "
            "(data.pad_id, or [PAD] in the vocabulary), else 0. Must equal the data's when both are set")
          .at_least(-1)
          .at_most(limits::kMaxVocab),
      model("dropout", &M::dropout, "BERT: hidden and attention dropout").at_least(0).below(1),
      model("attention", &M::attention,
            "BERT: fused = scaled_dot_product_attention (LibTorch 2.0+), plain = written-out softmax "
            "attention, auto = fused where available")
          .one_of({"auto", "fused", "plain"}).execution_only(),
      model("recompute", &M::recompute,
            "BERT: activation recomputation; each encoder layer keeps only its input for backward and runs "
            "again there, with the same dropout masks: the same gradients for a second forward of each layer (a "
            "bert-mini step took 1.39x as long on a 2-core CPU) and a fraction of the activation memory (bert-base: "
            "7.4 instead of 55.6 MiB per 128-token sample), which the plan's probe measures: a larger "
            "micro-batch, fewer accumulation steps")
          .execution_only(),
      model("options", &M::options,
            "settings of a program's own model that no other model key holds, a map of scalars read by its "
            "builder (ModelOptions in train/config.h), e.g. {hidden: 256, activation: gelu}; one at a time: "
            "--set model.options.hidden=512. An option the model does not read is an error; built-in models "
            "read none"),

      data("kind", &D::kind,
           "dataset kind; custom = datasets a program that links train::train passes to prepare_run "
           "(RunOptions::train_data), not available to the train command")
          .one_of({"idx", "synthetic", "image_folder", "tokens", "tsv", "custom"}),
      data("root", &D::root,
           "directory with the dataset files (required when kind is idx, image_folder or tsv; for tokens, "
           "relative token and vocab paths are taken in it)").free_on_resume(),
      data("train_images", &D::train_images, "idx: training images file in root; .gz is tried too").free_on_resume(),
      data("train_labels", &D::train_labels, "idx: training labels file in root; .gz is tried too").free_on_resume(),
      data("val_images", &D::val_images, "idx: validation images file in root; .gz is tried too").free_on_resume(),
      data("val_labels", &D::val_labels, "idx: validation labels file in root; .gz is tried too").free_on_resume(),
      data("train_dir", &D::train_dir,
           "image_folder: training split in root, one subdirectory of images per class").free_on_resume(),
      data("val_dir", &D::val_dir,
           "image_folder: validation split in root; its classes must be among train_dir's").free_on_resume(),
      data("image_size", &D::image_size,
           "image height = width (image_folder: the crop size); 0 = the dataset's own size "
           "(synthetic: 32, image_folder: 224)")
          .at_least(0)
          .at_most(limits::kMaxImageSize),
      data("resize_size", &D::resize_size,
           "image_folder validation: shorter side after resizing, before the center crop of "
           "image_size; 0 = round(image_size / 0.875)")
          .at_least(0)
          .at_most(2 * limits::kMaxImageSize).free_on_resume(),
      data("crop_min_scale", &D::crop_min_scale,
           "image_folder training: smallest area fraction of the random resized crop")
          .above(0)
          .at_most(1),
      data("channels", &D::channels, "synthetic: channels per image").at_least(1).at_most(limits::kMaxChannels),
      data("synthetic_train_samples", &D::synthetic_train_samples, "synthetic: training samples")
          .at_least(1)
          .at_most(limits::kMaxSamples),
      data("synthetic_val_samples", &D::synthetic_val_samples, "synthetic: validation samples")
          .at_least(1)
          .at_most(limits::kMaxSamples).free_on_resume(),
      data("mean", &D::mean, "per-channel normalisation mean; empty = no normalisation"),
      data("std", &D::std, "per-channel normalisation std; same length as mean").above(0),
      data("random_crop", &D::random_crop,
           "pad by crop_padding, then take a random crop of the original size"),
      data("crop_padding", &D::crop_padding, "padding in pixels for random_crop").at_least(0).at_most(limits::kMaxImageSize),
      data("random_flip", &D::random_flip, "random horizontal flip with p = 0.5"),
      data("shuffle", &D::shuffle, "shuffle the training set every epoch"),
      data("drop_last", &D::drop_last,
           "drop the last incomplete training batch of an epoch; true is the only value: every optimizer step "
           "takes exactly trainer.global_batch samples, and the epoch-seeded shuffle drops other samples each "
           "epoch (evaluation always covers every sample)"),
      data("workers", &D::workers,
           "loader worker threads; -1 = let the plan decide, and add workers while the training step waits for "
           "data (more than 5% of a logging window)")
          .at_least(-1)
          .at_most(limits::kMaxWorkers).free_on_resume(),
      data("prefetch", &D::prefetch, "batches prefetched per worker").at_least(1).at_most(limits::kMaxPrefetch).free_on_resume(),
      data("on_error", &D::on_error,
           "a sample that fails to load (corrupt file): raise = stop with an error naming it; "
           "skip = replace it by the next sample that loads, count and log it")
          .one_of({"raise", "skip"}).free_on_resume(),
      data("uint8", &D::uint8,
           "image_folder: deliver uint8 batches (a quarter of the bytes to copy, no float conversion in the "
           "loader) and apply mean / std on the device (normalize_on_device); auto = on when training on a GPU")
          .one_of({"auto", "on", "off"}).execution_only(),
      data("train_tokens", &D::train_tokens,
           "tokens: training token file (format in train/data/token_file.h); relative to root").free_on_resume(),
      data("val_tokens", &D::val_tokens, "tokens: validation token file; relative to root").free_on_resume(),
      data("vocab_file", &D::vocab_file,
           "tokens, tsv: BERT vocab.txt giving vocab_size and the [PAD] [UNK] [CLS] [SEP] [MASK] ids; "
           "relative to root; empty = from the token file").free_on_resume(),
      data("seq_len", &D::seq_len,
           "tokens, tsv: tokens per sample, [CLS] and [SEP] included (tsv: longer texts are truncated); at most "
           "model.max_positions for BERT")
          .at_least(3)
          .at_most(limits::kMaxSeqLen),
      data("pack", &D::pack,
           "tokens: concatenate documents into full sequences; false = one padded sample per document"),
      data("vocab_size", &D::vocab_size,
           "tokens: logits per position (at least the vocab file's and the token file's vocabulary; may be "
           "rounded up); 0 = the vocab file's, else the token file's")
          .at_least(0)
          .at_most(limits::kMaxVocab),
      data("pad_id", &D::pad_id,
           "tokens: [PAD] id (the model's attention mask is input != pad_id); -1 = from vocab_file, "
           "else the token file")
          .at_least(-1)
          .below(limits::kMaxVocab),
      data("unk_id", &D::unk_id, "tokens: [UNK] id, never masked; -1 = from vocab_file, else the token file")
          .at_least(-1)
          .below(limits::kMaxVocab),
      data("cls_id", &D::cls_id, "tokens: [CLS] id; -1 = from vocab_file, else the token file")
          .at_least(-1)
          .below(limits::kMaxVocab),
      data("sep_id", &D::sep_id, "tokens: [SEP] id; -1 = from vocab_file, else the token file")
          .at_least(-1)
          .below(limits::kMaxVocab),
      data("mask_id", &D::mask_id, "tokens: [MASK] id; -1 = from vocab_file, else the token file")
          .at_least(-1)
          .below(limits::kMaxVocab),
      data("mask_prob", &D::mask_prob, "tokens: share of the non-special tokens selected for MLM")
          .above(0)
          .at_most(1),
      data("mask_token_prob", &D::mask_token_prob, "tokens: share of the selected replaced by [MASK]")
          .at_least(0)
          .at_most(1),
      data("random_token_prob", &D::random_token_prob,
           "tokens: share of the selected replaced by a random non-special token of the data's vocabulary (not "
           "data.vocab_size's extra ids); the rest stay unchanged")
          .at_least(0)
          .at_most(1),
      data("train_tsv", &D::train_tsv, "tsv: training file in root, one text<TAB>label per line (one tab; the label without spaces around it; the sorted distinct labels are the classes)").free_on_resume(),
      data("val_tsv", &D::val_tsv, "tsv: validation file in root; its labels must be among train_tsv's").free_on_resume(),
      data("lowercase", &D::lowercase, "tsv: uncased vocab (lower-case and strip accents before WordPiece)"),

      optim("name", &O::name, "optimizer (train::register_optimizer adds names)")
          .checked_by(check_optimizer_name, "`sgd`, `adamw`, or a registered name"),
      optim("lr", &O::lr, "learning rate for global_batch (before any plan scaling)").above(0),
      optim("momentum", &O::momentum, "sgd: momentum").at_least(0).below(1),
      optim("nesterov", &O::nesterov, "sgd: use Nesterov momentum"),
      optim("weight_decay", &O::weight_decay, "weight decay coefficient").at_least(0),
      optim("beta1", &O::beta1, "adamw: decay rate of the first-moment estimate")
          .at_least(0)
          .below(1),
      optim("beta2", &O::beta2, "adamw: decay rate of the second-moment estimate")
          .at_least(0)
          .below(1),
      optim("eps", &O::eps, "adamw: term added to the denominator for stability").above(0),
      optim("decay_norm_and_bias", &O::decay_norm_and_bias,
            "apply weight decay to normalisation weights and biases too"),
      optim("clip_grad_norm", &O::clip_grad_norm, "maximum global gradient norm; 0 = no clipping")
          .at_least(0),
      optim("impl", &O::impl,
            "how a step runs: fused = one LibTorch kernel per parameter group, foreach = multi-tensor "
            "ops, loop = torch::optim one parameter at a time, auto = fused where LibTorch has the "
            "kernel for the device, else foreach")
          .one_of({"auto", "fused", "foreach", "loop"}).execution_only(),

      schedule("name", &S::name, "learning-rate schedule").one_of({"constant", "cosine", "step"}),
      schedule("warmup_steps", &S::warmup_steps, "linear warmup, in optimizer steps")
          .at_least(0)
          .at_most(limits::kMaxSteps),
      schedule("warmup_epochs", &S::warmup_epochs,
               "linear warmup in epochs; converted to steps and added to warmup_steps")
          .at_least(0)
          .at_most(limits::kMaxEpochs),
      schedule("min_lr_ratio", &S::min_lr_ratio, "cosine: floor as a fraction of the peak lr")
          .at_least(0)
          .at_most(1),
      schedule("milestones", &S::milestones,
               "step: increasing fractions of the total steps at which lr is multiplied by gamma")
          .above(0)
          .below(1),
      schedule("gamma", &S::gamma, "step: lr multiplier applied at each milestone")
          .above(0)
          .at_most(1),

      loss("label_smoothing", &LossConfig::label_smoothing,
           "label smoothing of the cross-entropy loss")
          .at_least(0)
          .below(1),

      trainer("epochs", &T::epochs, "epochs to train; 0 = not set (set epochs, max_steps or both)")
          .at_least(0)
          .at_most(limits::kMaxEpochs),
      trainer("max_steps", &T::max_steps,
              "optimizer steps to train; 0 = not set; with epochs, whichever ends first")
          .at_least(0)
          .at_most(limits::kMaxSteps),
      trainer("global_batch", &T::global_batch, "samples per optimizer step, summed over all ranks")
          .at_least(1)
          .at_most(limits::kMaxBatch)
          .is_required(),
      trainer("eval_every_steps", &T::eval_every_steps,
              "evaluate every N steps; 0 = at the end of every epoch (and of training)")
          .at_least(0)
          .at_most(limits::kMaxSteps).free_on_resume(),
      trainer("eval_batch", &T::eval_batch, "evaluation batch size; 0 = the plan's micro-batch")
          .at_least(0)
          .at_most(limits::kMaxBatch).free_on_resume(),
      trainer("seed", &T::seed, "random seed").at_least(0),
      trainer("device", &T::device,
              "device to train on; auto = cuda when available, else cpu; auto and cuda give local rank r "
              "GPU r (modulo the visible GPUs); cuda:N is one GPU for every rank")
          .checked_by(check_device, "`auto`, `cpu`, `cuda`, `cuda:N`").execution_only(),
      trainer("threads", &T::threads,
              "intra-op CPU threads; 0 = the cores available to the process")
          .at_least(0)
          .at_most(limits::kMaxThreads).execution_only(),
      trainer("stop_grace_s", &T::stop_grace_s,
              "after SIGTERM/SIGINT/SIGUSR1/SIGHUP, seconds to finish the step and write a checkpoint before exiting "
              "anyway, without one (exit 128 + the signal)")
          .above(0)
          .at_most(limits::kMaxSeconds).free_on_resume(),
      trainer("on_nonfinite", &T::on_nonfinite,
              "a non-finite loss (without loss scaling; with it the scaler skips the step): stop = exit 1 "
              "naming the step and the first parameter with a non-finite gradient, before the weights "
              "change; rollback = reload the newest checkpoint and skip that step's batches")
          .one_of({"stop", "rollback"}).free_on_resume(),
      trainer("max_rollbacks", &T::max_rollbacks,
              "on_nonfinite rollback: rollbacks allowed in one run before it stops as with `stop`")
          .at_least(1)
          .at_most(1000000).free_on_resume(),
      trainer("early_stop_patience", &T::early_stop_patience,
              "stop training, with a checkpoint, after this many evaluations in a row that do not improve "
              "the metric checkpoint.best ranks by (the count is in the checkpoints, so a resumed run goes on "
              "counting, and one resumed after an early stop does not train on unless the patience is raised); "
              "0 = off")
          .at_least(0)
          .at_most(1000000).free_on_resume(),
      trainer("early_stop_min_delta", &T::early_stop_min_delta,
              "for early_stop_patience, an evaluation improves only when it beats the best so far by more than "
              "this, in the metric's units (loss; accuracy and top5 as fractions, 0.001 = 0.1 points); "
              "best.pt still follows every improvement")
          .at_least(0)
          .at_most(1e9).free_on_resume(),

      tuning("device", &TuningConfig::device,
             "plan for this named device profile instead of the detected one (train plan --device)"),
      tuning("batch", &TuningConfig::batch,
             "fixed = the same global batch on every device; scale = grow it with the memory available")
          .one_of({"fixed", "scale"}),
      tuning("lr_scaling", &TuningConfig::lr_scaling,
             "how optim.lr follows a global batch other than base_batch (grown by scale mode, or set so)")
          .one_of({"linear", "sqrt", "none"}),
      tuning("base_batch", &TuningConfig::base_batch,
             "the global batch optim.lr was tuned for; 0 = trainer.global_batch")
          .at_least(0)
          .at_most(limits::kMaxBatch),
      tuning("max_global_batch", &TuningConfig::max_global_batch,
             "scale mode: upper bound for the grown global batch; 0 = 32 x base_batch")
          .at_least(0)
          .at_most(limits::kMaxBatch),
      tuning("micro_batch", &TuningConfig::micro_batch,
             "per-device micro-batch (at most global_batch); 0 = the plan chooses")
          .at_least(0)
          .at_most(limits::kMaxBatch),
      tuning("max_micro_batch", &TuningConfig::max_micro_batch,
             "upper bound for the plan's micro-batch choice; 0 = none")
          .at_least(0)
          .at_most(limits::kMaxBatch),
      tuning("probe", &TuningConfig::probe,
             "measure memory (and on a GPU throughput) to choose the micro-batch"),
      tuning("memory_fraction", &TuningConfig::memory_fraction,
             "share of the device's free memory the plan may fill")
          .above(0)
          .at_most(1),
      tuning("oom_recovery", &TuningConfig::oom_recovery,
             "out of memory inside a step: free it, halve the micro-batch, double the accumulation (the "
             "global batch stays) and redo the step with the same samples; every rank follows; the plan "
             "cache remembers it. false = exit 1"),
      tuning("cuda_graphs", &TuningConfig::cuda_graphs,
             "capture the training step (forward, backward, fused SGD or AdamW) in a CUDA graph after a few eager "
             "steps and replay it, so that the CPU launches one graph instead of every kernel; needs one process, "
             "no gradient accumulation, static shapes, a model whose forward never waits for the GPU, "
             "the fused optimizer and no loss scaling. auto = where those hold on a GPU, kept only if "
             "replaying is measured faster than the eager step; on = keep it whatever it measures")
          .one_of({"auto", "on", "off"}).execution_only(),
      tuning("cache_dir", &TuningConfig::cache_dir,
             "plan cache directory; empty = $XDG_CACHE_HOME/train/plans or ~/.cache/train/plans"),

      precision("mode", &PrecisionConfig::mode,
                "auto = bf16 autocast on compute capability >= 8.0, fp16 + loss scaling on 7.x, fp32 on CPU")
          .one_of({"auto", "fp32", "bf16", "fp16"}).execution_only(),
      precision("loss_scaling", &PrecisionConfig::loss_scaling,
                "dynamic loss scaling (GradScaler); auto = on with fp16, off otherwise")
          .one_of({"auto", "dynamic", "off"}).execution_only(),
      precision("channels_last", &PrecisionConfig::channels_last,
                "auto = channels_last for conv nets under mixed precision on a GPU, and on a CPU whose LibTorch has oneDNN when every convolution has 16+ output channels")
          .one_of({"auto", "on", "off"}).execution_only(),

      checkpoint("every_steps", &CheckpointConfig::every_steps,
                 "save a checkpoint every N optimizer steps; 0 = only at the end")
          .at_least(0)
          .at_most(limits::kMaxSteps),
      checkpoint("every_minutes", &CheckpointConfig::every_minutes,
                 "also save a checkpoint after the first step that ends this many minutes (wall time, rank 0's "
                 "clock) after the start or the last checkpoint, whatever the device's speed: what a preemption or "
                 "a kill can lose; 0 = off")
          .at_least(0)
          .at_most(1e6),
      checkpoint("keep_last", &CheckpointConfig::keep_last,
                 "checkpoints kept on disk, the newest ones, the final one counted among them")
          .at_least(1)
          .at_most(1000000),
      checkpoint("best", &CheckpointConfig::best,
                 "keep checkpoints/best.pt, the checkpoint of the evaluation with the highest top-1 accuracy "
                 "(accuracy), top-5 accuracy (top5) or lowest loss (loss), or the best value of a measure the "
                 "model itself reports (Model::eval_metrics, by its name), whatever keep_last prunes; "
                 "best.json beside it names its step and value; none = off")
          .checked_by(
              [](const std::string& v) -> std::string {
                const bool word = !v.empty() && std::all_of(v.begin(), v.end(), [](char c) {
                  return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                });
                return word ? "" : "must be none, accuracy, top5, loss or the name of a measure the model reports "
                                   "(letters, digits and '_'), got '" + v + "'";
              },
              "none, accuracy, top5, loss, or a model's metric name"),
      checkpoint("async", &CheckpointConfig::async,
                 "write checkpoints on a background thread: the training loop pays for a copy in host memory "
                 "(kept for the next checkpoint), not for the disk; the last checkpoint and one before a stop "
                 "are complete before the run ends; auto = on for a GPU run whose parameters and optimizer state "
                 "come to 256 MiB or more (on a CPU the writing thread would take cores from the training)")
          .one_of({"auto", "on", "off"}),

      logging("every_steps", &LoggingConfig::every_steps,
              "training metrics cadence (console, metrics.jsonl, TensorBoard), in optimizer steps")
          .at_least(1)
          .at_most(limits::kMaxSteps),
      logging("level", &LoggingConfig::level, "console log level")
          .one_of({"trace", "debug", "info", "warn", "error"}),
      logging("jsonl", &LoggingConfig::jsonl, "write metrics.jsonl in the run directory"),
      logging("tensorboard", &LoggingConfig::tensorboard,
              "write TensorBoard scalar event files (events.out.tfevents.*) in the run directory"),

      distributed("backend", &DistributedConfig::backend,
                  "collective backend; auto = nccl when the ranks have GPUs, gloo otherwise")
          .one_of({"auto", "nccl", "gloo"}).execution_only(),
      distributed("timeout_s", &DistributedConfig::timeout_s,
                  "seconds before a collective that a peer never joins fails (a dead or hung rank)")
          .above(0)
          .at_most(limits::kMaxSeconds).free_on_resume(),
      distributed("init_timeout_s", &DistributedConfig::init_timeout_s,
                  "seconds the rendezvous waits for every rank to join, and the ranks wait for each other to "
                  "finish measuring memory for the plan")
          .above(0)
          .at_most(limits::kMaxSeconds).free_on_resume(),
      distributed("checkpoint_timeout_s", &DistributedConfig::checkpoint_timeout_s,
                  "seconds the other ranks wait for rank 0 to write a checkpoint (a large model on a slow "
                  "disk takes longer than timeout_s)")
          .above(0)
          .at_most(limits::kMaxSeconds).free_on_resume(),
      distributed("bucket_mb", &DistributedConfig::bucket_mb,
                  "gradient bucket size in MiB; each bucket is all-reduced as soon as its gradients are ready")
          .above(0)
          .at_most(limits::kMaxBucketMib).free_on_resume(),
      distributed("first_bucket_mb", &DistributedConfig::first_bucket_mb,
                  "size of the first bucket (the last layers' gradients, ready first) in MiB")
          .above(0)
          .at_most(limits::kMaxBucketMib).free_on_resume(),
      distributed("find_unused_parameters", &DistributedConfig::find_unused_parameters,
                  "a parameter some rank left without a gradient counts as zero there; one no rank used is not "
                  "stepped (as in PyTorch's DDP); false = such a parameter is an error").free_on_resume(),
      distributed("broadcast_buffers", &DistributedConfig::broadcast_buffers,
                  "copy rank 0's buffers (BatchNorm running statistics) to every rank before each step"),
  };
}

const std::vector<Key>& schema() {
  static const std::vector<Key> keys = build_schema();
  return keys;
}

const Key* find_key(const std::string& path) {
  for (const Key& key : schema())
    if (key.path == path) return &key;
  return nullptr;
}

bool is_section(const std::string& name) {
  return std::any_of(std::begin(kSections), std::end(kSections),
                     [&](const SectionInfo& s) { return name == s.name; });
}

// ---- Did-you-mean ------------------------------------------------------------------------------

using detail::closest_index;

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string text;
  for (size_t i = 0; i < items.size(); ++i) text += (i ? separator : "") + items[i];
  return text;
}

std::string did_you_mean(const std::string& suggestion) {
  return "; did you mean '" + suggestion + "'?";
}

std::string check_optimizer_name(const std::string& name) {
  const std::vector<std::string> known = detail::accepted_optimizer_names();
  if (std::find(known.begin(), known.end(), name) != known.end()) return "";
  const auto suggestion = closest_index(name, known);
  return "must be one of " + join(known, ", ") + ", got '" + name + "'" +
         (suggestion ? did_you_mean(known[*suggestion]) : "") +
         (known.size() == 2 ? " (a program adds its own with train::register_optimizer)" : "");
}

// Names other training tools use for what train calls differently (PyTorch's DataLoader, Lightning,
// Hugging Face's TrainingArguments, DeepSpeed, mmcv): spelling distance would suggest the wrong key
// for them (`batch_size` is close to `tuning.batch`, a mode). Looked up by the key's own name in any
// section, before spelling. `note` explains where there is no key of that meaning.
struct KeyAlias {
  const char* name;
  const char* path;  // "" when train has no such key
  const char* note;  // "" when the path says it all
};
constexpr KeyAlias kKeyAliases[] = {
    {"batch_size", "trainer.global_batch", "the batch of one optimizer step, over all ranks"},
    {"train_batch_size", "trainer.global_batch", "the batch of one optimizer step, over all ranks"},
    {"global_batch_size", "trainer.global_batch", ""},
    {"total_batch_size", "trainer.global_batch", ""},
    {"per_device_train_batch_size", "tuning.micro_batch",
     "the per-rank batch is the plan's choice; tuning.micro_batch fixes it"},
    {"micro_batch_size", "tuning.micro_batch", ""},
    {"train_micro_batch_size_per_gpu", "tuning.micro_batch", ""},
    {"eval_batch_size", "trainer.eval_batch", ""},
    {"per_device_eval_batch_size", "trainer.eval_batch", ""},
    {"val_batch_size", "trainer.eval_batch", ""},
    {"learning_rate", "optim.lr", ""},
    {"base_lr", "optim.lr", "the lr for tuning.base_batch; tuning.lr_scaling scales it"},
    {"num_workers", "data.workers", ""},
    {"dataloader_num_workers", "data.workers", ""},
    {"prefetch_factor", "data.prefetch", ""},
    {"num_epochs", "trainer.epochs", ""},
    {"max_epochs", "trainer.epochs", ""},
    {"num_train_epochs", "trainer.epochs", ""},
    {"num_steps", "trainer.max_steps", ""},
    {"total_steps", "trainer.max_steps", ""},
    {"train_steps", "trainer.max_steps", ""},
    {"max_iters", "trainer.max_steps", ""},
    {"num_warmup_steps", "schedule.warmup_steps", ""},
    {"warmup_iters", "schedule.warmup_steps", ""},
    {"max_grad_norm", "optim.clip_grad_norm", ""},
    {"gradient_clip_val", "optim.clip_grad_norm", ""},
    {"grad_clip", "optim.clip_grad_norm", ""},
    {"gradient_accumulation_steps", "",
     "accumulation follows from trainer.global_batch / (micro-batch x ranks); fix the micro-batch with "
     "tuning.micro_batch"},
    {"accumulate_grad_batches", "",
     "accumulation follows from trainer.global_batch / (micro-batch x ranks); fix the micro-batch with "
     "tuning.micro_batch"},
    {"pin_memory", "", "pinned memory is the plan's choice: on whenever batches go to a GPU"},
    {"amp", "precision.mode", "auto, fp32, bf16 or fp16"},
    {"mixed_precision", "precision.mode", "auto, fp32, bf16 or fp16"},
    {"dtype", "precision.mode", "auto, fp32, bf16 or fp16"},
    {"optimizer", "optim.name", ""},
    {"scheduler", "schedule.name", ""},
    {"lr_scheduler", "schedule.name", ""},
    {"save_steps", "checkpoint.every_steps", ""},
    {"save_total_limit", "checkpoint.keep_last", ""},
    {"train_time_interval", "checkpoint.every_minutes", ""},
    {"metric_for_best_model", "checkpoint.best", "accuracy, top5, loss or a model's metric (none = off)"},
    {"load_best_model_at_end", "checkpoint.best", "accuracy, top5 or loss: keeps checkpoints/best.pt"},
    {"save_top_k", "checkpoint.best", "accuracy, top5 or loss: keeps checkpoints/best.pt"},
    {"early_stopping_patience", "trainer.early_stop_patience", ""},
    {"patience", "trainer.early_stop_patience", "with checkpoint.best naming the metric it watches"},
    {"min_delta", "trainer.early_stop_min_delta", ""},
    {"early_stopping_threshold", "trainer.early_stop_min_delta", ""},
    {"logging_steps", "logging.every_steps", ""},
    {"log_every_n_steps", "logging.every_steps", ""},
    {"log_interval", "logging.every_steps", ""},
    {"eval_steps", "trainer.eval_every_steps", ""},
    {"eval_interval", "trainer.eval_every_steps", ""},
    {"val_check_interval", "trainer.eval_every_steps", ""},
    {"random_seed", "trainer.seed", ""},
    {"num_labels", "model.num_classes", ""},
    {"betas", "optim.beta1", "beta1 and beta2 are two keys"},
    {"arch", "model.name", ""},
};

// The alias entry for a key's name, if any (case does not count).
const KeyAlias* key_alias(const std::string& name) {
  // Checked once, on first use: every alias names a real key and none is a key's own name (the
  // tests reach this through any unknown key).
  static const bool table_ok = [] {
    for (const KeyAlias& alias : kKeyAliases) {
      for (const Key& key : schema()) {
        if (key.name == alias.name)
          throw std::logic_error(std::string("config alias '") + alias.name + "' is the name of key " + key.path);
      }
      if (*alias.path && !find_key(alias.path))
        throw std::logic_error(std::string("config alias '") + alias.name + "' names no key: " + alias.path);
    }
    return true;
  }();
  (void)table_ok;
  const std::string lower = detail::ascii_lower(name);
  for (const KeyAlias& alias : kKeyAliases) {
    if (lower == alias.name) return &alias;
  }
  return nullptr;
}

std::string alias_problem(const KeyAlias& alias) {
  std::string text = "unknown key";
  if (*alias.path) text += did_you_mean(alias.path);
  if (*alias.note) text += std::string(*alias.path ? " (" : "; ") + alias.note + (*alias.path ? ")" : "");
  return text;
}

std::string unknown_section_problem(const std::string& name) {
  std::vector<std::string> names;
  for (const SectionInfo& s : kSections) names.emplace_back(s.name);
  if (const auto i = closest_index(name, names)) return "unknown section" + did_you_mean(names[*i]);
  // A flat config's key at the top (`lr: 0.1`, `batch_size: 64`): name its section.
  std::string path;
  for (const Key& key : schema()) {
    if (key.name == detail::ascii_lower(name)) path = key.path;
  }
  const KeyAlias* alias = key_alias(name);
  if (path.empty() && alias) path = alias->path;
  if (!path.empty()) {
    const size_t dot = path.find('.');
    return "unknown section; keys go under their section: did you mean '" + path + "', written " +
           path.substr(0, dot) + ": {" + path.substr(dot + 1) + ": ...}?";
  }
  if (alias) return "unknown section; " + std::string(alias->note);
  return "unknown section; the sections are " + join(names, ", ");
}

// An unknown key in a known section: another tool's name for a key first, then a key of that
// section, then a key of the same name in another section (e.g. `lr` written under `trainer` ->
// `optim.lr`).
std::string unknown_key_problem(const std::string& section, const std::string& name) {
  if (const KeyAlias* alias = key_alias(name)) return alias_problem(*alias);
  std::vector<std::string> here, elsewhere, elsewhere_paths;
  for (const Key& key : schema()) {
    if (key.section == section) {
      here.push_back(key.name);
    } else {
      elsewhere.push_back(key.name);
      elsewhere_paths.push_back(key.path);
    }
  }
  if (const auto i = closest_index(name, here))
    return "unknown key" + did_you_mean(section + "." + here[*i]);
  if (const auto i = closest_index(name, elsewhere))
    return "unknown key" + did_you_mean(elsewhere_paths[*i]);
  return "unknown key in section '" + section + "'";
}

// An unknown dotted path, as given to --set: a key of a known section is handled as in a file;
// otherwise the closest full path, then the closest key name (`lr` -> `optim.lr`).
std::string unknown_path_problem(const std::string& path) {
  const size_t dot = path.find('.');
  if (dot != std::string::npos && is_section(path.substr(0, dot)))
    return unknown_key_problem(path.substr(0, dot), path.substr(dot + 1));
  const size_t last_dot = path.rfind('.');
  const std::string last_name = last_dot == std::string::npos ? path : path.substr(last_dot + 1);
  if (const KeyAlias* alias = key_alias(last_name)) return alias_problem(*alias);
  std::vector<std::string> paths, names;
  for (const Key& key : schema()) {
    paths.push_back(key.path);
    names.push_back(key.name);
  }
  // A key's own name without its section ("epochs" for trainer.epochs): that key, before any
  // path that merely looks alike.
  std::vector<std::string> same_name;
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == detail::ascii_lower(last_name)) same_name.push_back(paths[i]);
  }
  if (same_name.size() == 1) return "unknown key" + did_you_mean(same_name.front());
  if (same_name.size() > 1) return "unknown key; keys are written section.name: " + join(same_name, ", ");
  if (const auto i = closest_index(path, paths)) return "unknown key" + did_you_mean(paths[*i]);
  if (const auto i = closest_index(last_name, names)) return "unknown key" + did_you_mean(paths[*i]);
  return "unknown key (keys are written section.name, e.g. optim.lr)";
}

// ---- Formatting values -------------------------------------------------------------------------

// Shortest text that parses back to exactly `v`.
std::string format_number(double v) { return log::exact(v); }

// Like format_number, but keeps a float recognisable as one: 1.0, not 1.
std::string format_float(double v) {
  std::string text = format_number(v);
  if (text.find_first_of(".e") == std::string::npos) text += ".0";
  return text;
}

// A YAML scalar that reads back as exactly `s` (quoted only when a plain scalar would not).
std::string yaml_string(const std::string& s) {
  YAML::Emitter out;
  out << s;
  return out.c_str();
}

std::string format_value(const Value& value) {
  struct Formatter {
    std::string operator()(int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const { return format_float(v); }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(const std::string& v) const { return yaml_string(v); }
    std::string operator()(const std::vector<double>& v) const {
      std::string text = "[";
      for (size_t i = 0; i < v.size(); ++i) text += (i ? ", " : "") + format_float(v[i]);
      return text + "]";
    }
    std::string operator()(const OptionMap& v) const {
      std::string text = "{";
      for (const auto& [name, value] : v) text += (text.size() > 1 ? ", " : "") + yaml_string(name) + ": " + yaml_string(value);
      return text + "}";
    }
  };
  return std::visit(Formatter{}, value);
}

// A key's value as to_yaml writes it (a model option's as given), or nothing for a path that names
// no key (a section) or an option that is not set.
std::optional<std::string> value_text(const Config& config, const std::string& path) {
  if (const Key* key = find_key(path)) return format_value(key->get(config));
  const std::string options_prefix = "model.options.";
  if (path.compare(0, options_prefix.size(), options_prefix) != 0) return std::nullopt;
  const auto& options = config.model.options.values();
  const auto it = options.find(path.substr(options_prefix.size()));
  if (it == options.end()) return std::nullopt;
  return it->second;
}

const char* type_name(Type type) {
  switch (type) {
    case Type::Int: return "int";
    case Type::Float: return "float";
    case Type::Bool: return "bool";
    case Type::String: return "string";
    case Type::Enum: return "enum";
    case Type::FloatList: return "list of floats";
    case Type::Map: return "map";
  }
  return "";
}

// "> 0", "<= 1", "[0, 1)"; empty when the key has no bounds. An int key's bounds are written as
// ints (16777216, not 1.6777216e+07), as the key takes them.
std::string describe_range(const Key& key) {
  const auto bound = [&key](double v) {
    return key.type == Type::Int ? std::to_string(static_cast<int64_t>(v)) : format_number(v);
  };
  if (key.lower && key.upper)
    return std::string(key.lower->inclusive ? "[" : "(") + bound(key.lower->value) + ", " + bound(key.upper->value) +
           (key.upper->inclusive ? "]" : ")");
  if (key.lower) return (key.lower->inclusive ? ">= " : "> ") + bound(key.lower->value);
  if (key.upper) return (key.upper->inclusive ? "<= " : "< ") + bound(key.upper->value);
  return "";
}

bool in_range(const Key& key, double v) {
  if (key.lower && (key.lower->inclusive ? v < key.lower->value : v <= key.lower->value))
    return false;
  if (key.upper && (key.upper->inclusive ? v > key.upper->value : v >= key.upper->value))
    return false;
  return true;
}

std::string range_problem(const Key& key, const std::string& text) {
  const std::string range = describe_range(key);
  const bool interval = key.lower && key.upper;
  return "must be " + std::string(interval ? "in " : "") + range + ", got " + text;
}

// ---- Reading values ----------------------------------------------------------------------------

[[noreturn]] void fail(const std::string& where, const std::string& path,
                       const std::string& problem) {
  throw ConfigError(where + ": key '" + path + "': " + problem);
}

// Where values come from: a YAML file (positions from node marks) or one --set argument.
struct Origin {
  std::string source;  // file name, or "--set key=value"
  bool has_marks;      // false for --set: marks there are positions in the value text only

  std::string at(const YAML::Mark& mark) const {
    if (!has_marks || mark.is_null()) return source;
    return source + ":" + std::to_string(mark.line + 1) + ":" + std::to_string(mark.column + 1);
  }
};

// yaml-cpp tags quoted scalars "!" and plain ones "?". A quoted "0.1" is a string, not a number.
bool is_quoted(const YAML::Node& node) { return node.Tag() == "!"; }

std::string describe_node(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a map";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar:
      return is_quoted(node) ? "the quoted string \"" + node.Scalar() + "\""
                             : "'" + node.Scalar() + "'";
    default: return "no value";
  }
}

// Where from_chars should start: it takes a leading '-' but not the '+' YAML numbers may have.
const char* number_start(const std::string& text) {
  const bool explicit_plus = text.size() > 1 && text[0] == '+' && text[1] != '-';
  return text.data() + (explicit_plus ? 1 : 0);
}

std::optional<int64_t> parse_int(const std::string& text) {
  const char* first = number_start(text);
  const char* last = text.data() + text.size();
  int64_t value = 0;
  const auto result = std::from_chars(first, last, value);
  if (result.ec != std::errc() || result.ptr != last || first == last) return std::nullopt;
  return value;
}

std::optional<double> parse_float(const std::string& text) {
  const char* first = number_start(text);
  const char* last = text.data() + text.size();
  double value = 0;
  const auto result = std::from_chars(first, last, value);
  if (result.ec != std::errc() || result.ptr != last || first == last || !std::isfinite(value))
    return std::nullopt;
  return value;
}

// Numbers and bools must be plain scalars: in YAML a quoted "0.1" is a string.
bool is_plain(const YAML::Node& node) { return node.IsScalar() && !is_quoted(node); }

// YAML 1.1's words, as PyYAML reads them too: true/false, yes/no, on/off, in lower, Title or UPPER
// case. Not yaml-cpp's single letters y/n: "shuffle: n" is more likely a slip than "false".
std::optional<bool> parse_bool(const YAML::Node& node) {
  const std::string& text = node.Scalar();
  if (text.size() == 1) return std::nullopt;
  bool value = false;
  if (!YAML::convert<bool>::decode(node, value)) return std::nullopt;
  return value;
}

[[noreturn]] void fail_type(const std::string& where, const std::string& path,
                            const std::string& expected, const YAML::Node& node) {
  fail(where, path, "expected " + expected + ", got " + describe_node(node));
}

// `text` is the value as written, for the message.
void require_in_range(const Key& key, double number, const std::string& text,
                      const std::string& where, const std::string& path) {
  if (!in_range(key, number)) fail(where, path, range_problem(key, text));
}

// One float: the value of a float key, or one element of a list-of-floats key.
double read_float(const Key& key, const YAML::Node& node, const std::string& where,
                  const std::string& path) {
  const std::optional<double> value = is_plain(node) ? parse_float(node.Scalar()) : std::nullopt;
  if (!value) fail_type(where, path, "a float", node);
  require_in_range(key, *value, node.Scalar(), where, path);
  return *value;
}

std::string key_name(const YAML::Node& key, const std::string& parent, const Origin& origin,
                     std::map<std::string, YAML::Mark>& seen);

// A model.options name: what `--set model.options.NAME=...` can address.
std::string option_name_problem(const std::string& name) {
  if (name.empty()) return "empty option name";
  for (const char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-')
      return "option names are letters, digits, '_' and '-' (they are addressed as model.options.NAME)";
  }
  return "";
}

// One model.options value: a scalar, kept as written.
std::string read_option_value(const YAML::Node& node, const std::string& where, const std::string& path) {
  if (!node.IsScalar()) fail_type(where, path, "a number, bool or string", node);
  if (node.Scalar().find('\0') != std::string::npos) fail(where, path, "holds a NUL character (\\0)");
  return node.Scalar();
}

// Converts `node` to the key's type and checks type, range, allowed values and the key's own
// rule. `where` locates `node`; a null node counts as an empty string or an empty list.
Value read_value(const Key& key, const YAML::Node& node, const std::string& where,
                 const Origin& origin) {
  switch (key.type) {
    case Type::Int: {
      const std::optional<int64_t> value = is_plain(node) ? parse_int(node.Scalar()) : std::nullopt;
      if (!value) fail_type(where, key.path, "an int", node);
      require_in_range(key, static_cast<double>(*value), node.Scalar(), where, key.path);
      return *value;
    }
    case Type::Float: return read_float(key, node, where, key.path);
    case Type::Bool: {
      const std::optional<bool> value = is_plain(node) ? parse_bool(node) : std::nullopt;
      if (!value) fail_type(where, key.path, "a bool (true or false; also yes/no, on/off)", node);
      return *value;
    }
    case Type::String:
    case Type::Enum: {
      if (!node.IsScalar() && !node.IsNull()) fail_type(where, key.path, "a string", node);
      const std::string text = node.IsNull() ? "" : node.Scalar();
      // YAML's "\0" escape: the C strings of paths and messages would end there, unseen.
      if (text.find('\0') != std::string::npos) {
        fail(where, key.path, "holds a NUL character (\\0), which no path, name or setting can contain");
      }
      if (key.type == Type::Enum &&
          std::find(key.allowed.begin(), key.allowed.end(), text) == key.allowed.end()) {
        const auto suggestion = closest_index(text, key.allowed);
        fail(where, key.path,
             "must be one of " + join(key.allowed, ", ") + ", got '" + text + "'" +
                 (suggestion ? did_you_mean(key.allowed[*suggestion]) : ""));
      }
      if (key.check) {
        const std::string problem = key.check(text);
        if (!problem.empty()) fail(where, key.path, problem);
      }
      return text;
    }
    case Type::FloatList: {
      if (node.IsNull()) return std::vector<double>{};
      if (!node.IsSequence())
        fail_type(where, key.path, "a list of floats such as [0.5, 0.5]", node);
      std::vector<double> values;
      for (size_t i = 0; i < node.size(); ++i) {
        const YAML::Node element = node[i];
        values.push_back(read_float(key, element, origin.at(element.Mark()),
                                    key.path + "[" + std::to_string(i) + "]"));
      }
      return values;
    }
    case Type::Map: {
      if (node.IsNull()) return OptionMap{};
      if (!node.IsMap()) fail_type(where, key.path, "a map of settings such as {hidden: 256}", node);
      OptionMap values;
      std::map<std::string, YAML::Mark> seen;
      for (const auto& entry : node) {
        const std::string name = key_name(entry.first, key.path, origin, seen);
        const std::string path = key.path + "." + name;
        if (const std::string problem = option_name_problem(name); !problem.empty())
          fail(origin.at(entry.first.Mark()), path, problem);
        values[name] = read_option_value(entry.second, origin.at(entry.second.IsNull() ? entry.first.Mark()
                                                                                          : entry.second.Mark()),
                                         path);
      }
      return values;
    }
  }
  return {};
}

// ---- Building a Config -------------------------------------------------------------------------

// Applies a YAML document and overrides to a default Config, remembering where each key was set
// so that the checks that run at the end can point at the offending line.
class ConfigBuilder {
 public:
  explicit ConfigBuilder(std::string source_name) : source_(std::move(source_name)) {
    config_.source = source_;
  }

  // `positions` false: errors name the source without a line (a document written by to_yaml).
  void apply_document(const std::string& text, bool positions = true);
  void apply_override(const std::string& assignment);
  Config validated() const;

 private:
  void assign(const Key& key, const YAML::Node& value, const std::string& where,
              const Origin& origin) {
    key.set(config_, read_value(key, value, where, origin));
    set_at_[key.path] = where;
    if (key.type == Type::Map) {  // each option's own place, for the errors of the model's builder
      for (auto it = set_at_.begin(); it != set_at_.end();) {
        it = it->first.rfind(key.path + ".", 0) == 0 ? set_at_.erase(it) : std::next(it);
      }
      if (value.IsMap()) {
        for (const auto& entry : value) set_at_[key.path + "." + entry.first.Scalar()] = origin.at(entry.second.Mark());
      }
    }
  }
  void apply_section(const std::string& section, const YAML::Node& body, const Origin& origin);
  void check_bert_sizes() const;

  // Where a key was last set; the file name when it was never set.
  std::string where_set(const std::string& path) const {
    const auto it = set_at_.find(path);
    return it == set_at_.end() ? source_ : it->second;
  }
  bool from_override(const std::string& path) const {
    const auto it = set_at_.find(path);
    return it != set_at_.end() && it->second.compare(0, 6, "--set ") == 0;
  }
  // Of two keys a rule relates, the one to name: the one a --set gave when the other came from the
  // file (that change broke the rule), else `usual`.
  std::string blame(const std::string& usual, const std::string& other) const {
    return from_override(other) && !from_override(usual) ? other : usual;
  }

  std::string source_;
  Config config_;
  std::map<std::string, std::string> set_at_;  // key path -> "FILE:LINE:COL" or "--set ..."
};

// The name of a map key, which must be a plain scalar; rejects a repeat of an earlier key.
// yaml-cpp keeps duplicate keys as separate entries, so they can be detected here.
std::string key_name(const YAML::Node& key, const std::string& parent, const Origin& origin,
                     std::map<std::string, YAML::Mark>& seen) {
  const std::string where = origin.at(key.Mark());
  if (!key.IsScalar()) {
    const std::string problem = "expected a key name, got " + describe_node(key);
    if (parent.empty()) throw ConfigError(where + ": " + problem);
    fail(where, parent, problem);
  }
  const std::string name = key.Scalar();
  const std::string path = parent.empty() ? name : parent + "." + name;
  const auto [first, inserted] = seen.emplace(name, key.Mark());
  if (!inserted)
    fail(where, path,
         "duplicate key (first given at " + std::to_string(first->second.line + 1) + ":" +
             std::to_string(first->second.column + 1) + ")");
  return name;
}

// yaml-cpp 0.7 (Debian 12's) never returns from LoadAll on some malformed input, such as a
// stray ',' (yaml-cpp issue 1040): its parser keeps reporting an empty document at the same
// position, and memory grows until the process is killed. Walk the documents with a parser that
// builds nothing first, and stop with an error where a document starts where the previous one
// did. Syntax errors are left for LoadAll to report. Returns where it stalled and the problem.
std::optional<std::pair<YAML::Mark, std::string>> find_stalled_yaml(const std::string& text) {
  struct DocumentStarts : YAML::EventHandler {
    std::optional<YAML::Mark> previous;
    std::optional<YAML::Mark> stalled;
    void OnDocumentStart(const YAML::Mark& mark) override {
      if (previous && previous->pos == mark.pos) stalled = mark;
      previous = mark;
    }
    void OnDocumentEnd() override {}
    void OnNull(const YAML::Mark&, YAML::anchor_t) override {}
    void OnAlias(const YAML::Mark&, YAML::anchor_t) override {}
    void OnScalar(const YAML::Mark&, const std::string&, YAML::anchor_t, const std::string&) override {}
    void OnSequenceStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
    void OnSequenceEnd() override {}
    void OnMapStart(const YAML::Mark&, const std::string&, YAML::anchor_t, YAML::EmitterStyle::value) override {}
    void OnMapEnd() override {}
  } starts;
  std::istringstream stream(text);
  YAML::Parser parser(stream);
  try {
    while (!starts.stalled && parser.HandleNextDocument(starts)) {
    }
  } catch (const YAML::Exception&) {
    return std::nullopt;
  }
  if (!starts.stalled) return std::nullopt;
  const size_t pos = static_cast<size_t>(starts.stalled->pos);
  const unsigned char c = pos < text.size() ? static_cast<unsigned char>(text[pos]) : 0;
  return std::make_pair(*starts.stalled, "unexpected " + (std::isgraph(c) ? "'" + std::string(1, static_cast<char>(c)) + "'"
                                                                          : std::string("character")));
}

// YAML indents with spaces only, and a tab there gives yaml-cpp's "illegal map value" or "end of
// map not found", which say nothing of the tab: " (line 2 is indented with a tab; YAML indents
// with spaces)" for the first such line up to the error's, or "".
std::string tab_indent_hint(const std::string& text, const YAML::Mark& mark) {
  if (mark.is_null()) return "";
  std::istringstream lines(text);
  std::string line;
  for (int n = 0; n <= mark.line && std::getline(lines, line); ++n) {
    const size_t indent = line.find_first_not_of(" \t");
    if (line.find('\t') < std::min(indent, line.size())) {
      return " (line " + std::to_string(n + 1) + " is indented with a tab; YAML indents with spaces)";
    }
  }
  return "";
}

void ConfigBuilder::apply_document(const std::string& text, bool positions) {
  const Origin origin{source_, positions};
  std::vector<YAML::Node> documents;
  if (const auto stalled = find_stalled_yaml(text)) {
    throw ConfigError(origin.at(stalled->first) + ": invalid YAML: " + stalled->second +
                      tab_indent_hint(text, stalled->first));
  }
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(origin.at(e.mark) + ": invalid YAML: " + e.msg + tab_indent_hint(text, e.mark));
  }
  if (documents.empty() || (documents.size() == 1 && documents.front().IsNull()))
    throw ConfigError(source_ +
                      ": empty config; expected a map of sections such as model:, data:, trainer:");
  if (documents.size() > 1)
    throw ConfigError(origin.at(documents[1].Mark()) + ": expected one YAML document, found " +
                      std::to_string(documents.size()));
  const YAML::Node& root = documents.front();
  if (!root.IsMap())
    throw ConfigError(origin.at(root.Mark()) +
                      ": expected a map of sections such as model:, data:, trainer:, got " +
                      describe_node(root));

  std::map<std::string, YAML::Mark> seen;
  for (const auto& entry : root) {
    const std::string section = key_name(entry.first, "", origin, seen);
    if (!is_section(section))
      fail(origin.at(entry.first.Mark()), section, unknown_section_problem(section));
    apply_section(section, entry.second, origin);
  }
}

void ConfigBuilder::apply_section(const std::string& section, const YAML::Node& body,
                                  const Origin& origin) {
  if (body.IsNull()) return;  // `optim:` with every key commented out
  if (!body.IsMap())
    fail(origin.at(body.Mark()), section, "expected a map of keys, got " + describe_node(body));
  std::map<std::string, YAML::Mark> seen;
  for (const auto& entry : body) {
    const std::string name = key_name(entry.first, section, origin, seen);
    const std::string path = section + "." + name;
    const Key* key = find_key(path);
    if (!key) fail(origin.at(entry.first.Mark()), path, unknown_key_problem(section, name));
    // An omitted value (`lr:`) has no useful mark of its own; point at its key instead.
    const YAML::Node& value = entry.second;
    const std::string where = origin.at(value.IsNull() ? entry.first.Mark() : value.Mark());
    assign(*key, value, where, origin);
  }
}

std::string trim(const std::string& s) {
  const size_t first = s.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return s.substr(first, s.find_last_not_of(" \t") - first + 1);
}

void ConfigBuilder::apply_override(const std::string& assignment) {
  const Origin origin{"--set " + assignment, false};
  const size_t equals = assignment.find('=');
  if (equals == std::string::npos)
    throw ConfigError(origin.source + ": expected key=value, e.g. --set optim.lr=0.1");
  const std::string path = trim(assignment.substr(0, equals));
  if (path.empty())
    throw ConfigError(origin.source + ": empty key; expected key=value, e.g. --set optim.lr=0.1");
  const Key* key = find_key(path);
  const std::string options_prefix = "model.options.";
  const bool one_option = !key && path.rfind(options_prefix, 0) == 0;
  if (one_option) {
    if (const std::string problem = option_name_problem(path.substr(options_prefix.size())); !problem.empty())
      fail(origin.source, path, problem);
  } else if (!key && is_section(path)) {
    // "--set optim={lr: 0.5}" or "--set trainer=3": a whole section, which --set does not take.
    std::string example = path + ".NAME";
    for (const Key& k : schema()) {
      if (k.section == path) {
        example = k.path;
        break;
      }
    }
    fail(origin.source, path,
         "a section, not a key; --set takes one key at a time, e.g. --set " + example +
             "=... (train config --reference lists them)");
  } else if (!key) {
    fail(origin.source, path, unknown_path_problem(path));
  }
  // The whole value must be one YAML value: text after it ("[0.5] junk", "'mlp' junk") is an
  // error, not dropped, and so is a stray ',' (which also stalls yaml-cpp 0.7, see above).
  const std::string text = assignment.substr(equals + 1);
  if (const auto stalled = find_stalled_yaml(text)) fail(origin.source, path, "invalid YAML value: " + stalled->second);
  // A '#' at the start or after a blank, outside quotes, begins a YAML comment: the rest of the
  // value would be dropped without a word ("data.root=/d #2" would read /d).
  char quote = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quote) {
      if (c == quote) quote = 0;
    } else if (c == '\'' || c == '"') {
      quote = c;
    } else if (c == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t')) {
      fail(origin.source, path,
           "'" + trim(text.substr(i)) + "' would be read as a YAML comment and dropped; quote the whole value if "
           "it is one string (--set 'key=\"a #b\"')");
    }
  }
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAll(text);
  } catch (const YAML::Exception& e) {
    fail(origin.source, path, "invalid YAML value: " + e.msg);
  }
  if (documents.size() > 1) {
    const size_t pos = std::min(text.size(), static_cast<size_t>(std::max(0, documents[1].Mark().pos)));
    fail(origin.source, path,
         "unexpected text after the value: '" + trim(text.substr(pos)) +
             "'; quote the whole value if it is one string (--set 'key=\"a b\"')");
  }
  const YAML::Node value = documents.empty() ? YAML::Node() : documents.front();
  if (one_option) {  // one option added or replaced, the others kept
    OptionMap options = config_.model.options.values();
    options[path.substr(options_prefix.size())] = read_option_value(value, origin.source, path);
    config_.model.options = ModelOptions(std::move(options));
    set_at_[path] = origin.source;
    return;
  }
  assign(*key, value, origin.source, origin);
}

// Required keys and rules that involve more than one key, checked once everything is applied.
Config ConfigBuilder::validated() const {
  for (const Key& key : schema()) {
    if (!key.required) continue;
    if (set_at_.count(key.path) == 0)
      fail(source_, key.path, "required key is missing (" + key.meaning + ")");
    const Value value = key.get(config_);
    if (std::holds_alternative<std::string>(value) && std::get<std::string>(value).empty())
      fail(where_set(key.path), key.path, "must not be empty");
  }

  const TrainerConfig& trainer = config_.trainer;
  if (trainer.epochs == 0 && trainer.max_steps == 0) {
    const bool only_max_steps_given =
        set_at_.count("trainer.max_steps") && !set_at_.count("trainer.epochs");
    const std::string path = only_max_steps_given ? "trainer.max_steps" : "trainer.epochs";
    fail(where_set(path), path, "set trainer.epochs or trainer.max_steps (or both) to a value > 0");
  }

  const DataConfig& data = config_.data;
  if (!data.drop_last) {
    // Accepted and ignored, it would lose the same samples with no word.
    fail(where_set("data.drop_last"), "data.drop_last",
         "false is not supported: every optimizer step takes exactly trainer.global_batch samples, so the last "
         "incomplete batch of an epoch is dropped (other samples each epoch: the order is shuffled per epoch); "
         "remove the key, or pick a global batch that divides the training set");
  }
  if (data.mean.size() != data.std.size()) {
    const std::string path = set_at_.count("data.std") ? blame("data.std", "data.mean") : "data.mean";
    fail(where_set(path), path,
         "data.mean has " + std::to_string(data.mean.size()) + " entries and data.std has " +
             std::to_string(data.std.size()) + "; they must have the same length");
  }
  if (data.kind == "tsv" && data.vocab_file.empty())
    fail(where_set("data.vocab_file"), "data.vocab_file", "required when data.kind is 'tsv' (a BERT vocab.txt)");
  if ((data.kind == "idx" || data.kind == "image_folder" || data.kind == "tsv") && data.root.empty())
    fail(where_set("data.root"), "data.root",
         "required when data.kind is '" + data.kind + "' (the directory with the dataset files)");
  if (data.uint8 == "on" && data.kind != "image_folder")
    fail(where_set("data.uint8"), "data.uint8",
         "only image_folder delivers uint8 batches; data.kind is '" + data.kind + "'");
  if (data.mask_token_prob + data.random_token_prob > 1.0 + 1e-9) {
    const std::string path = set_at_.count("data.random_token_prob")
                                 ? blame("data.random_token_prob", "data.mask_token_prob")
                                 : "data.mask_token_prob";
    fail(where_set(path), path,
         "data.mask_token_prob + data.random_token_prob is " +
             format_number(data.mask_token_prob + data.random_token_prob) + "; it must be <= 1");
  }
  if (data.kind == "image_folder" && data.resize_size > 0 && data.image_size > 0 &&
      data.resize_size < data.image_size)
    fail(where_set(blame("data.resize_size", "data.image_size")), blame("data.resize_size", "data.image_size"),
         "data.resize_size (" + std::to_string(data.resize_size) + ") is smaller than data.image_size (" +
             std::to_string(data.image_size) + "), so the center crop would not fit");

  const OptimConfig& optim = config_.optim;
  if (optim.name == "sgd" && optim.nesterov && optim.momentum == 0)
    fail(where_set(blame("optim.nesterov", "optim.momentum")), blame("optim.nesterov", "optim.momentum"),
         "Nesterov momentum needs optim.momentum > 0 (as in torch.optim.SGD); optim.momentum is 0");

  const std::vector<double>& milestones = config_.schedule.milestones;
  for (size_t i = 1; i < milestones.size(); ++i)
    if (milestones[i] <= milestones[i - 1])
      fail(where_set("schedule.milestones"), "schedule.milestones",
           "must be strictly increasing, got " + format_number(milestones[i]) + " after " +
               format_number(milestones[i - 1]));

  check_bert_sizes();
  if (config_.model.recompute && !models::detail::is_bert_model(config_.model.name)) {
    fail(where_set("model.recompute"), "model.recompute",
         "only the BERT models (bert, bert-mlm, bert-classifier) recompute their layers; model '" +
             config_.model.name + "' keeps its activations");
  }

  if (trainer.early_stop_patience > 0 && config_.checkpoint.best == "none")
    fail(where_set(blame("trainer.early_stop_patience", "checkpoint.best")),
         blame("trainer.early_stop_patience", "checkpoint.best"),
         "early stopping watches the metric checkpoint.best ranks evaluations by, and checkpoint.best is none; "
         "set it to loss, accuracy or top5");

  const TuningConfig& tuning = config_.tuning;
  if (tuning.micro_batch > 0 && tuning.micro_batch > trainer.global_batch)
    fail(where_set("tuning.micro_batch"), "tuning.micro_batch",
         "is " + std::to_string(tuning.micro_batch) + ", larger than trainer.global_batch (" +
             std::to_string(trainer.global_batch) + ")");
  if (tuning.micro_batch > 0 && tuning.max_micro_batch > 0 &&
      tuning.micro_batch > tuning.max_micro_batch)
    fail(where_set("tuning.micro_batch"), "tuning.micro_batch",
         "is " + std::to_string(tuning.micro_batch) + ", larger than tuning.max_micro_batch (" +
             std::to_string(tuning.max_micro_batch) + ")");
  Config config = config_;
  config.origins = set_at_;
  for (const auto& [path, where] : set_at_) {
    if (auto value = value_text(config, path)) config.origin_values.emplace(path, std::move(*value));
  }
  return config;
}

// The BERT sizes that the model would reject when it is built: checked here, so that `train check`
// finds them and the message points at the key's line.
void ConfigBuilder::check_bert_sizes() const {
  const ModelConfig& model = config_.model;
  if (!models::detail::is_bert_model(model.name)) return;
  const models::detail::BertPresetSizes* preset = models::detail::find_bert_preset(model.preset);
  if (!preset) return;  // model.preset is an enum of the presets
  const std::string from_preset = " (model.preset " + model.preset + "'s)";
  const int64_t hidden = model.hidden_size > 0 ? model.hidden_size : preset->hidden;
  const int64_t heads = model.heads > 0 ? model.heads : preset->heads;
  if (hidden % heads != 0) {
    // Name the key the user gave; with both given, the heads (the smaller change).
    const bool heads_given = model.heads > 0 && set_at_.count("model.heads");
    std::vector<std::string> divisors;
    for (int64_t d = 1; d <= hidden && d <= 64; ++d)
      if (hidden % d == 0) divisors.push_back(std::to_string(d));
    if (heads_given)
      fail(where_set("model.heads"), "model.heads",
           std::to_string(heads) + " attention heads do not divide the hidden size " + std::to_string(hidden) +
               (model.hidden_size > 0 ? " (model.hidden_size)" : from_preset) +
               "; each head takes hidden_size / heads features. Heads that divide it: " + join(divisors, ", "));
    fail(where_set("model.hidden_size"), "model.hidden_size",
         std::to_string(hidden) + " is not a multiple of the " + std::to_string(heads) + " attention heads" +
             (model.heads > 0 ? " (model.heads)" : from_preset) + "; set it to a multiple of " +
             std::to_string(heads) + " or set model.heads");
  }
  const DataConfig& data = config_.data;
  const int64_t positions = model.max_positions > 0 ? model.max_positions : models::detail::kBertPresetPositions;
  if ((data.kind == "tokens" || data.kind == "tsv") && data.seq_len > positions) {
    const bool only_positions_given = set_at_.count("model.max_positions") && !set_at_.count("data.seq_len");
    const std::string path =
        only_positions_given ? "model.max_positions" : blame("data.seq_len", "model.max_positions");
    fail(where_set(path), path,
         "data.seq_len is " + std::to_string(data.seq_len) + " tokens per sample, more than the model's " +
             std::to_string(positions) + " position embeddings (model.max_positions" +
             (model.max_positions > 0 ? "" : ", the preset's") +
             "); lower data.seq_len or raise model.max_positions");
  }
}

// ---- Reference ---------------------------------------------------------------------------------

std::string markdown_cell(const std::string& text) {
  std::string cell;
  for (const char c : text) {
    if (c == '|') cell += '\\';
    cell += c;
  }
  return cell;
}

std::string reference_constraint(const Key& key) {
  if (key.type == Type::Enum) {
    std::vector<std::string> quoted;
    for (const std::string& v : key.allowed) quoted.push_back("`" + v + "`");
    return join(quoted, ", ");
  }
  if (!key.check_summary.empty()) return key.check_summary;
  const std::string range = describe_range(key);
  if (range.empty()) return "";
  return key.type == Type::FloatList ? "each " + range : range;
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::vector<std::string>& overrides) {
  ConfigBuilder builder(source_name);
  builder.apply_document(yaml_text);
  for (const std::string& assignment : overrides) builder.apply_override(assignment);
  return builder.validated();
}

// ---- model.options ----------------------------------------------------------------------------

const std::string* ModelOptions::find(const std::string& name) const {
  asked_.insert(name);
  const auto it = values_.find(name);
  return it == values_.end() ? nullptr : &it->second;
}

bool ModelOptions::has(const std::string& name) const { return find(name) != nullptr; }

namespace {

[[noreturn]] void option_type_error(const std::string& name, const std::string& expected, const std::string& text) {
  throw ConfigError("key 'model.options." + name + "': expected " + expected + ", got '" + text + "'");
}

}  // namespace

int64_t ModelOptions::get_int(const std::string& name, int64_t fallback) const {
  const std::string* text = find(name);
  if (!text) return fallback;
  const std::optional<int64_t> value = parse_int(*text);
  if (!value) option_type_error(name, "an int", *text);
  return *value;
}

double ModelOptions::get_float(const std::string& name, double fallback) const {
  const std::string* text = find(name);
  if (!text) return fallback;
  const std::optional<double> value = parse_float(*text);
  if (!value) option_type_error(name, "a float", *text);
  return *value;
}

bool ModelOptions::get_bool(const std::string& name, bool fallback) const {
  const std::string* text = find(name);
  if (!text) return fallback;
  const std::optional<bool> value = parse_bool(YAML::Node(*text));
  if (!value) option_type_error(name, "a bool (true or false; also yes/no, on/off)", *text);
  return *value;
}

std::string ModelOptions::get_string(const std::string& name, const std::string& fallback) const {
  const std::string* text = find(name);
  return text ? *text : fallback;
}

std::vector<std::string> ModelOptions::unasked() const {
  std::vector<std::string> names;
  for (const auto& [name, value] : values_) {
    if (asked_.count(name) == 0) names.push_back(name);
  }
  return names;
}

std::string Config::where(const std::string& key_path) const {
  const std::string whole = source.empty() ? "<config>" : source;
  const auto it = origins.find(key_path);
  if (it == origins.end()) return whole;
  const auto read = origin_values.find(key_path);
  if (read != origin_values.end() && value_text(*this, key_path) != read->second) return whole + " (as changed in code)";
  return it->second;
}

std::string locate_config_error(const Config& config, const std::string& message) {
  // Already located (a parse error, or located once before).
  if (!config.source.empty() && message.compare(0, config.source.size() + 1, config.source + ":") == 0)
    return message;
  if (message.compare(0, 6, "--set ") == 0) return message;
  std::string path;
  if (message.compare(0, 5, "key '") == 0) {
    const size_t end = message.find('\'', 5);
    if (end != std::string::npos) path = message.substr(5, end - 5);
  } else {
    // "data.image_size is 32 but ...", "data.kind: ...": a key path followed by a space or ':'.
    const size_t end = message.find_first_of(" :");
    const std::string word = message.substr(0, end);
    if (find_key(word)) path = word;
  }
  return config.where(path) + ": " + message;  // the source alone when no key is named
}

std::string locate_data_error(const Config& config, const std::string& message) {
  return message.compare(0, 5, "key '") == 0 ? locate_config_error(config, message) : message;
}

void validate_config(const Config& config) {
  // The checks parse_config applies, run on the config's own values as to_yaml writes them (which
  // parse_config reads back exactly). A config that came from a file passes unless code changed it.
  ConfigBuilder builder(config.source.empty() ? "<config built in code>" : config.source + " (as changed in code)");
  builder.apply_document(to_yaml(config), /*positions=*/false);
  (void)builder.validated();
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (files::is_directory(path))
    throw ConfigError(path + ": is a directory, expected a YAML config file");
  // A FIFO or a terminal would block the read until someone writes to it; /dev/stdin is read
  // on purpose (`train check /dev/stdin < run.yaml`).
  if (const std::string problem = files::input_file_problem(path); !problem.empty() && path != "/dev/stdin")
    throw ConfigError(path + ": " + problem + ", expected a YAML config file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(path + ": cannot open config file (" + std::strerror(errno) + ")");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError(path + ": cannot read config file");
  return parse_config(text.str(), path, overrides);
}

std::vector<ConfigChange> config_changes(const Config& before, const Config& after) {
  std::vector<ConfigChange> changes;
  for (const Key& key : schema()) {
    const Value a = key.get(before), b = key.get(after);
    if (!(a == b)) changes.push_back({key.path, format_value(a), format_value(b), key.on_resume});
  }
  return changes;
}

std::vector<ConfigValue> config_values(const Config& config) {
  std::vector<ConfigValue> values;
  for (const Key& key : schema()) values.push_back({key.path, format_value(key.get(config)), key.on_resume});
  return values;
}

std::string to_yaml(const Config& config) {
  // Trailing comments are aligned per section, but long values do not push them further out.
  constexpr size_t kMaxAlignedWidth = 40;
  std::ostringstream out;
  out << kResolvedConfigHeader << "\n";
  if (!config.source.empty()) out << "# Loaded from " << config.source << "\n";
  for (const SectionInfo& section : kSections) {
    std::vector<std::pair<std::string, const Key*>> lines;
    size_t width = 0;
    for (const Key& key : schema()) {
      if (key.section != section.name) continue;
      lines.emplace_back("  " + key.name + ": " + format_value(key.get(config)), &key);
      width = std::max(width, lines.back().first.size());
    }
    width = std::min(width, kMaxAlignedWidth);
    out << "\n" << section.name << ":  # " << section.meaning << "\n";
    for (const auto& [line, key] : lines)
      out << line << std::string(width > line.size() ? width - line.size() : 0, ' ') << "  # "
          << key->meaning << "\n";
  }
  return out.str();
}

namespace {

const char* on_resume_name(OnResume on_resume) {
  switch (on_resume) {
    case OnResume::Trajectory: return "trajectory";
    case OnResume::Execution: return "execution";
    case OnResume::Free: return "free";
  }
  return "trajectory";
}

}  // namespace

std::string config_reference() {
  static const Config defaults;
  std::vector<std::string> required;
  for (const Key& key : schema())
    if (key.required) required.push_back("`" + key.path + "`");

  std::ostringstream out;
  out << "# Configuration reference\n\n"
      << "Required: " << join(required, ", ")
      << ", at least one of `trainer.epochs` / `trainer.max_steps` > 0, and `data.root` when "
      << "`data.kind` is `idx`, `image_folder` or `tsv` (which also needs `data.vocab_file`). "
      << "Every other key has the default shown. Any key can be overridden on the command line "
      << "with `--set section.key=value`.\n\n"
      << "The *on resume* column says what another value means when `train fit --resume` continues "
      << "a run whose checkpoint was written with the old one: `trajectory`, a different training "
      << "(the resumed run is no longer the uninterrupted one); `execution`, the same training "
      << "computed differently (other kernels, rounding or summation order: not bit for bit); "
      << "`free`, neither (where files are, what is logged or validated, how failures are handled). "
      << "The resumed run warns about the first two, naming the keys.\n";
  for (const SectionInfo& section : kSections) {
    out << "\n## " << section.name << "\n\n"
        << section.meaning << "\n\n"
        << "| key | type | default | allowed / range | on resume | meaning |\n"
        << "|---|---|---|---|---|---|\n";
    for (const Key& key : schema()) {
      if (key.section != section.name) continue;
      const std::string default_text =
          key.required ? "required" : "`" + format_value(key.get(defaults)) + "`";
      out << "| `" << key.path << "` | " << type_name(key.type) << " | "
          << markdown_cell(default_text) << " | " << markdown_cell(reference_constraint(key))
          << " | " << on_resume_name(key.on_resume) << " | " << markdown_cell(key.meaning) << " |\n";
    }
  }
  return out.str();
}

namespace detail {

void accept_optimizer_name(const std::string& name) {
  OptimizerNames& accepted = optimizer_names_accepted();
  const std::lock_guard<std::mutex> lock(accepted.mutex);
  if (std::find(accepted.names.begin(), accepted.names.end(), name) == accepted.names.end()) {
    accepted.names.push_back(name);
  }
}

std::vector<std::string> accepted_optimizer_names() {
  OptimizerNames& accepted = optimizer_names_accepted();
  const std::lock_guard<std::mutex> lock(accepted.mutex);
  return accepted.names;
}

std::string optimizer_name_problem(const std::string& name) { return check_optimizer_name(name); }

int built_in_state_per_parameter(const OptimConfig& optim) {
  if (optim.name == "adamw") return 2;
  if (optim.name == "sgd") return optim.momentum > 0 ? 1 : 0;
  return -1;
}

}  // namespace detail

}  // namespace train
